"""A short step's residual stream padded to the row count MLX CUDA's matmuls run cheapest.

MLX CUDA's 4-bit quantized matmul pays per row from 2 to 7 rows and takes a GEMM path from 8
rows on that costs what one row costs (17408x5120: 0.079 ms at 1 row, 0.138 at 2, 0.058 at 8;
/work/shared/MEASUREMENTS.md), and a 27B-shape step at 4 bits is bound by those matmuls: 14.4 GB
read at the ~0.7 TB/s that the one-row kernel reaches is the step's 20 ms. So a step of 2 to 7
rows (a verify step `[y, d]`, a deeper draft, a small batch) runs its projections, norms and
MLPs on `PAD_TO` rows: `ModelShard` appends zero rows to the stream once at its entry and drops
them at its exit, and each token mixer (GatedDeltaNet's conv and recurrence, attention over the
KV cache) takes the real rows only and hands its output back padded again.

The real rows compute what they would alone: every row of a matmul, norm or MLP depends on its
own row only, and a zero row stays exactly zero through a dense layer (no biases; RMSNorm and
SwiGLU of zero are zero), so no padded row can overflow either. On the CPU the outputs are
bit-identical (tests/test_decode_fast_path.py); on CUDA the GEMM path sums in another order than
the few-row kernel, as any batch size would. MoE shards are not padded: their router would send
the zero rows to experts, which costs expert reads for nothing.

An earlier version padded around each projection (three more graph nodes per projection) and
lost 7 ms of host time on the verify step (BENCHMARKS.md, issue 10, run E). Padding once per step
adds a slice and a pad per token mixer, inside the compiled layer where layers are compiled.

Whether it is on is decided per backend (`enabled`): on for CUDA where measured to pay
(BENCHMARKS.md, issue 10); off on Metal (its few-row kernels were not measured against its
GEMM here: never pad where it may cost) and on the CPU (its quantized matmul is linear in rows,
so padding would only add work). `set_enabled` overrides the choice (the tests, the benchmark's
A/B runs), and can pad one-row steps too (`one_row`), which the benchmark measures apart.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["PAD_TO", "enabled", "pad_rows", "padded_rows", "set_enabled"]

PAD_TO = 8  # MLX CUDA's quantized matmul takes its GEMM path from 8 rows on

_override: bool | None = None
_one_row = False


def set_enabled(on: bool | None, *, one_row: bool = False) -> None:
    """Force padding on or off (None: the per-backend default); `one_row` pads one-row steps
    too (plain decode), which is off by default."""
    global _override, _one_row
    _override, _one_row = on, one_row


def enabled() -> bool:
    if _override is not None:
        return _override
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


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
