"""A short step's residual stream padded to the row count MLX CUDA's matmuls run cheapest.

MLX CUDA's 4-bit quantized matmul pays per row from 2 to 7 rows and takes a GEMM path from 8
rows on (17408x5120: 0.079 ms at 1 row, 0.138 at 2, 0.058 at 8 per call; MEASUREMENTS.md). So a
step of 2 to 7 rows (a verify step `[y, d]`, a deeper draft, a small batch) could run its
projections, norms and MLPs on `PAD_TO` rows: `ModelShard` appends zero rows to the stream once
at its entry and drops them at its exit, and each token mixer (GatedDeltaNet's conv and
recurrence, attention over the KV cache) takes the real rows only and hands its output back
padded again.

The real rows compute what they would alone: every row of a matmul, norm or MLP depends on its
own row only, and a zero row stays exactly zero through a dense layer (no biases; RMSNorm and
SwiGLU of zero are zero). On the CPU the outputs are bit-identical (tests/test_decode_fast_path.py);
on CUDA the GEMM path sums in another order than the few-row kernel, as any batch size would.
MoE shards are never padded: their router would send the zero rows to experts.

Measured, it does not pay, so it is off on every backend (BENCHMARKS.md, issue 10, run L). Those
per-call figures are throughput: they time independent matmuls, which MLX CUDA's step graph runs
side by side. A model's matmuls form a chain, each waiting for the one before, and in a chain
the 8-row GEMM kernel takes 1.96x the one-row kernel's time (27B-shape MLPs: 0.38 against 0.20
ms a layer; 2 rows 0.34 ms). The padded 27B verify step took 45.4 ms against 39.6 unpadded, and
a one-token step padded to 8 rows 40.8 ms against 20.9. On the CPU the quantized matmul is
linear in rows, and Metal was not measured (never pad where it may cost). It stays as an A/B
switch (`set_enabled`, the benchmark's `+padded` variants): a later MLX whose few-row GEMM is as
fast in a chain as alone would make it pay, and `gpu_bench --diagnose` shows when.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["PAD_TO", "enabled", "pad_rows", "padded_rows", "set_enabled"]

PAD_TO = 8  # MLX CUDA's quantized matmul takes its GEMM path from 8 rows on

_override: bool | None = None
_one_row = False


def set_enabled(on: bool | None, *, one_row: bool = False) -> None:
    """Force padding on or off (None: the default, off); `one_row` pads one-row steps too
    (plain decode)."""
    global _override, _one_row
    _override, _one_row = on, one_row


def enabled() -> bool:
    return bool(_override)  # off by default on every backend (see above)


def padded_rows(rows: int) -> int:
    """The row count a step of `rows` positions runs its dense layers on."""
    smallest = 1 if _one_row else 2
    return PAD_TO if smallest <= rows < PAD_TO and enabled() else rows


def pad_rows(x: mx.array, rows: int) -> mx.array:
    """`x` [1, n, ...] with zero rows appended along axis 1 up to `rows` (>= n)."""
    missing = rows - x.shape[1]
    if missing == 0:
        return x
    return mx.pad(x, [(0, 0), (0, missing)] + [(0, 0)] * (x.ndim - 2))
