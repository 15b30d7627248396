"""A short step's residual stream padded to the row count MLX CUDA's matmuls run cheapest.

MLX CUDA's 4-bit quantized matmul pays per row from 2 to 7 rows and takes a GEMM path from 8
rows on (17408x5120: 0.079 ms at 1 row, 0.138 at 2, 0.058 at 8 per call; the project's shared
MEASUREMENTS.md). So a step of 2 to 7 rows (a verify step `[y, d]`, a deeper draft, a small
batch) could run its projections, norms and MLPs on `PAD_TO` rows: `ModelShard` appends zero rows
to the stream once at its entry and drops them at its exit, and each token mixer (GatedDeltaNet's
conv and recurrence, attention over the KV cache) takes the real rows only and hands its output
back padded again.

The real rows compute what they would alone: every row of a matmul, norm or MLP depends on its
own row only, and a zero row stays exactly zero through a dense layer (no biases; RMSNorm and
SwiGLU of zero are zero). On the CPU the outputs are bit-identical (tests/test_decode_fast_path.py);
on CUDA the GEMM path sums in another order than the few-row kernel, as any batch size would.
MoE shards are never padded: their router would send the zero rows to experts.

Measured on an H200 at the 27B shape, 4 bits (BENCHMARKS.md, issue 10, runs L and N), it pays
from 4 rows on, not below, so on CUDA it pads steps of 4 to 7 rows (`PAD_FROM`): the backbone's
4-position step took 43.6 ms padded against 64.5 unpadded, while its 2-position (verify) step
took 41.0 against 34.7 and a one-position step padded to 8 rows 40.8 against 20.9. That is why
the per-call figures above mislead: they are throughput, timing independent matmuls that MLX
CUDA's step graph runs side by side. A model's matmuls form a chain, each waiting for the one
before, and in a chain the 8-row GEMM kernel takes twice the one-row kernel's time (27B-shape
MLPs: 0.41 against 0.20 ms a layer; 2 rows 0.35, 4 rows 0.65). So padding buys deeper MTP
drafts and small batches their rows at the price of about two one-row steps, and the adaptive
depth (`cluster.decode.mtp_depth`, from the node's measured step costs) sees that price.
Off on the CPU (its quantized matmul is linear in rows: padding only adds work) and on Metal
(not measured here: never pad where it may cost). On CUDA, steps of 1 to 3 rows run the
few-row kernel instead (`cluster.model.few_row_matmul`), which reads the weights once for all
of them; from 4 rows on MLX's GEMM on the padded rows was the faster (27B-shape backbone on an
H100, run Q: 44.2 ms padded against 49.6 with the kernel); since, 4-bit steps of 4 to 32 rows
run the tensor-core kernel (`cluster.model.tensor_core_matmul`), whose cost is flat from 1 to 8
rows, so padding them changes nothing there. `set_enabled` overrides the choice (the tests, the
benchmark's `+padded` variants).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["PAD_FROM", "PAD_TO", "enabled", "pad_rows", "padded_rows", "set_enabled"]

PAD_TO = 8  # MLX CUDA's quantized matmul takes its GEMM path from 8 rows on
PAD_FROM = 4  # fewer rows run cheaper unpadded on CUDA (see above)

_override: bool | None = None
_from_rows = PAD_FROM


def set_enabled(on: bool | None, *, from_rows: int = PAD_FROM) -> None:
    """Force padding on or off (None: the per-backend default) for steps of `from_rows` rows
    and more (1: plain decode too)."""
    global _override, _from_rows
    if not 1 <= from_rows <= PAD_TO:
        raise ValueError(f"from_rows must be 1..{PAD_TO}, got {from_rows}")
    _override, _from_rows = on, from_rows


def enabled() -> bool:
    if _override is not None:
        return _override
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def padded_rows(rows: int) -> int:
    """The row count a step of `rows` positions runs its dense layers on."""
    return PAD_TO if _from_rows <= rows < PAD_TO and enabled() else rows


def pad_rows(x: mx.array, rows: int) -> mx.array:
    """`x` [1, n, ...] with zero rows appended along axis 1 up to `rows` (>= n)."""
    missing = rows - x.shape[1]
    if missing == 0:
        return x
    return mx.pad(x, [(0, 0), (0, missing)] + [(0, 0)] * (x.ndim - 2))
