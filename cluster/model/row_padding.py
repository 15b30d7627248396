"""A short step's residual stream padded to the row count MLX CUDA's matmuls run cheapest.

MLX CUDA's 4-bit quantized matmul pays per row from 2 to 7 rows and takes a GEMM path from 8
rows on. So a step of 2 to 7 rows (a verify step `[y, d]`, a deeper draft, a small
batch) could run its projections, norms and MLPs on `PAD_TO` rows: `ModelShard` appends zero rows
to the stream once at its entry and drops them at its exit, and each token mixer (GatedDeltaNet's
conv and recurrence, attention over the KV cache) takes the real rows only and hands its output
back padded again.

The real rows compute what they would alone: every row of a matmul, norm or MLP depends on its
own row only, and a zero row stays exactly zero through a dense layer (no biases; RMSNorm and
SwiGLU of zero are zero). On the CPU the outputs are bit-identical (tests/test_decode_fast_path.py);
on CUDA the GEMM path sums in another order than the few-row kernel, as any batch size would.
MoE shards are never padded: their router would send the zero rows to experts.

It pays from `PAD_FROM` rows on, not below: in a chain of matmuls (each waiting for the one
before, as a model's are) MLX CUDA's 8-row GEMM kernel takes about twice the one-row kernel's
time, so padding buys a deeper MTP draft or a small batch its rows at about the price of two
one-row steps, and the adaptive depth (`cluster.decode.mtp_depth`, from the node's measured
step costs) sees that price. Steps of 1 to 3 rows run the few-row kernel instead
(`cluster.model.few_row_matmul`), which reads the weights once for all of them; 4-bit steps of
4 to 32 rows run the tensor-core kernel (`cluster.model.tensor_core_matmul`), whose cost is
flat from 1 to 8 rows, so padding them changes nothing there. Whether a shard pads, and from
how many rows, is its `DecodeFastPath.pad_rows_from` (`cluster.model.fast_path`): on CUDA only
by default.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["PAD_FROM", "PAD_TO", "pad_rows", "padded_rows"]

PAD_TO = 8  # MLX CUDA's quantized matmul takes its GEMM path from 8 rows on
PAD_FROM = 4  # fewer rows run cheaper unpadded on CUDA (see above)


def padded_rows(rows: int, from_rows: int | None) -> int:
    """The row count a step of `rows` positions runs its dense layers on, where steps of
    `from_rows` rows and more (None: none) are padded."""
    return PAD_TO if from_rows is not None and from_rows <= rows < PAD_TO else rows


def pad_rows(x: mx.array, rows: int) -> mx.array:
    """`x` [1, n, ...] with zero rows appended along axis 1 up to `rows` (>= n)."""
    missing = rows - x.shape[1]
    if missing == 0:
        return x
    return mx.pad(x, [(0, 0), (0, missing)] + [(0, 0)] * (x.ndim - 2))
