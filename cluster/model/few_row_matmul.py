"""A quantized matmul for the few rows of a decode step, as one CUDA kernel.

A decode step multiplies a few rows (one token, a verify step `[y, d]`, a draft of depth 2) by
every weight matrix of the model, so its time should be the time to read the weights once.
MLX CUDA's own kernels do not get there: its one-row kernel reads well below the memory's
bandwidth and it pays per row from 2 to 7 rows. This kernel reads each weight once for all rows
(up to 32; the model's layers use it up to `MAX_ROWS`). Its design:

- a warp computes `ROWS_PER_WARP` output columns; each lane takes 32 consecutive inputs (one
  16-byte load of 4-bit weights per column, half a quantization group of 64) per step along
  the input axis, and the warp's lanes together cover 1024 inputs per step;
- the lane multiplies the raw quantized values by each row's inputs and applies the group's
  scale and bias once per step: `sum(w * x) = scale * sum(q * x) + bias * sum(x)`, where
  `sum(x)` is shared by every column;
- quantized values become floats by the exponent trick (`0x4B000000 | q` is the float
  `2**23 + q`), not by integer conversion, which runs at a sixteenth of the FMA rate;
- the warp's partial sums meet by shuffles and lane `i` writes the i-th of them.

Every row is computed in the same order whatever the row count, so a row's output does not
depend on the rows beside it (batch invariance): a verify step's first row equals the plain
step of the same token bit for bit, which keeps greedy decoding with MTP identical to decoding
without it on this path too.

A batch's steps of 4 to 32 rows at 4 bits take the tensor-core kernel
(`cluster.model.tensor_core_matmul`) on the same layers. They run on CUDA (`available`), where
a shard's `DecodeFastPath.few_row_kernel` (`cluster.model.fast_path`) asks for them; Metal and
the CPU keep MLX's kernels. It takes affine quantization at 4 or 8 bits with groups of 32, 64
or 128, inputs of 2-byte floats whose width is a multiple of 32, and scales of the input's
dtype; anything else, and steps of rows neither kernel takes, go to `mx.quantized_matmul`.
Applied at load (`cluster.model.loading.load_shard(..., for_decoding=True)`) by
`use_few_row_kernel`, which swaps each eligible `nn.QuantizedLinear` for a
`FewRowQuantizedLinear` over the same arrays; a shard loaded without the kernel keeps MLX's
`nn.QuantizedLinear`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from cluster.model import tensor_core_matmul

__all__ = [
    "MAX_ROWS", "FewRowQuantizedLinear", "available", "build_kernel_variants",
    "few_row_quantized_matmul", "use_few_row_kernel", "use_mlx_kernels",
]  # fmt: skip

# The kernel is memory-bound up to a few rows and compute-bound after, where MLX's GEMM on rows
# padded to 8 (`cluster.model.row_padding`) or the tensor-core kernel computes them cheaper.
MAX_ROWS = 3
ROWS_PER_WARP = 4  # output columns per warp: each loaded input row serves this many
THREADS_PER_BLOCK = 128
LANE_VALUES = 32  # inputs a lane takes per step; within one group for every group size below
GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)

_HEADER = """
// The float 2**23 + q for 0 <= q < 2**23, minus 2**23: q as a float in two full-rate ops.
__device__ __forceinline__ float quantized_value(uint32_t q) {
  return __uint_as_float(0x4B000000u | q) - 8388608.0f;
}
"""

# Template constants: T (the input, scale and output dtype), R (rows), BITS, GROUP, NR (output
# columns per warp). Inputs: x [R, K], w [N, K * BITS / 32] uint32, scales and biases
# [N, K / GROUP]. Output: y [R, N].
_SOURCE = """
  constexpr int VALUES_PER_WORD = 32 / BITS;
  constexpr int LANE_VALUES = 32;
  constexpr int LANE_WORDS = LANE_VALUES / VALUES_PER_WORD;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int n_out = w_shape[0];
  const int k_words = w_shape[1];
  const int k_in = k_words * VALUES_PER_WORD;
  const int groups = k_in / GROUP;
  const int lane = threadIdx.x & 31;
  const int first = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * NR;
  if (first >= n_out) {
    return;  // the whole warp: its columns start past the end
  }

  const uint32_t* w_col[NR];
  const T* scale_col[NR];
  const T* bias_col[NR];
#pragma unroll
  for (int c = 0; c < NR; ++c) {
    const size_t n = min(first + c, n_out - 1);  // past the end: computed, not written
    w_col[c] = w + n * k_words;
    scale_col[c] = scales + n * groups;
    bias_col[c] = biases + n * groups;
  }

  float acc[NR][R];
#pragma unroll
  for (int c = 0; c < NR; ++c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[c][r] = 0.0f;
    }
  }

  for (int k = lane * LANE_VALUES; k < k_in; k += 32 * LANE_VALUES) {
    uint32_t words[NR][LANE_WORDS];
#pragma unroll
    for (int c = 0; c < NR; ++c) {
      const uint4* src = reinterpret_cast<const uint4*>(w_col[c] + k / VALUES_PER_WORD);
#pragma unroll
      for (int i = 0; i < LANE_WORDS / 4; ++i) {
        const uint4 v = src[i];
        words[c][4 * i] = v.x;
        words[c][4 * i + 1] = v.y;
        words[c][4 * i + 2] = v.z;
        words[c][4 * i + 3] = v.w;
      }
    }
    float dot[NR][R];
    float x_sum[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      x_sum[r] = 0.0f;
#pragma unroll
      for (int c = 0; c < NR; ++c) {
        dot[c][r] = 0.0f;
      }
    }
#pragma unroll
    for (int part = 0; part < LANE_VALUES / 8; ++part) {
      float xv[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4 v = *reinterpret_cast<const uint4*>(x + size_t(r) * k_in + k + 8 * part);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          xv[r][j] = static_cast<float>(e[j]);
          x_sum[r] += xv[r][j];
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = 8 * part + j;
#pragma unroll
        for (int c = 0; c < NR; ++c) {
          const uint32_t word = words[c][i / VALUES_PER_WORD];
          const float q = quantized_value((word >> ((i % VALUES_PER_WORD) * BITS)) & MASK);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            dot[c][r] = fmaf(xv[r][j], q, dot[c][r]);
          }
        }
      }
    }
#pragma unroll
    for (int c = 0; c < NR; ++c) {
      const float s = static_cast<float>(scale_col[c][k / GROUP]);
      const float b = static_cast<float>(bias_col[c][k / GROUP]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[c][r] = fmaf(s, dot[c][r], fmaf(b, x_sum[r], acc[c][r]));
      }
    }
  }

  // Every lane ends with every sum; lane c * R + r writes column c of row r.
  float mine = 0.0f;
#pragma unroll
  for (int c = 0; c < NR; ++c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[c][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
      }
      if (lane == c * R + r) {
        mine = v;
      }
    }
  }
  if (lane < NR * R) {
    const int c = lane / R;
    const int r = lane % R;
    if (first + c < n_out) {
      y[size_t(r) * n_out + first + c] = static_cast<T>(mine);
    }
  }
"""


def available() -> bool:
    """Whether the kernel can run here: MLX on CUDA."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def _kernel() -> Callable:
    return mx.fast.cuda_kernel(
        name="few_row_quantized_matmul",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_SOURCE,
        header=_HEADER,
    )


def _rows_per_warp(rows: int) -> int:
    # The lanes write the warp's columns x rows sums, one each: at most 32 of them.
    return max(1, min(ROWS_PER_WARP, 32 // rows))


def few_row_quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int
) -> mx.array:
    """`x @ dequantize(w).T` for `x` of shape [rows, K], 1 <= rows <= 32, as
    `mx.quantized_matmul(x, w, scales, biases, transpose=True)` computes it (CUDA only)."""
    rows, width = x.shape
    if not 1 <= rows <= 32:
        raise ValueError(f"the few-row kernel takes 1 to 32 rows, got {rows}")
    if x.dtype not in (mx.bfloat16, mx.float16) or scales.dtype != x.dtype:
        raise ValueError(f"the few-row kernel takes 2-byte floats, got {x.dtype}/{scales.dtype}")
    if width % LANE_VALUES or width != w.shape[1] * 32 // bits:
        raise ValueError(f"inputs of width {width} do not fit weights of shape {w.shape}")
    n_out = w.shape[0]
    per_warp = _rows_per_warp(rows)
    warps = -(-n_out // per_warp)
    (y,) = _kernel()(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("R", rows), ("BITS", bits), ("GROUP", group_size),
                  ("NR", per_warp)],
        grid=(warps * 32, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[(rows, n_out)],
        output_dtypes=[x.dtype],
    )  # fmt: skip
    return y


class FewRowQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose steps of up to `MAX_ROWS` rows run the few-row kernel, and
    at 4 bits those of `tensor_core_matmul.MIN_ROWS` to `tensor_core_matmul.MAX_ROWS` rows (a
    batch's decode or verify step) the tensor-core kernel, where they run (`available`);
    anything else computes as `nn.QuantizedLinear` does."""

    @staticmethod
    def supports(layer: nn.Module) -> bool:
        """Whether `layer` is a plain affine `nn.QuantizedLinear` the kernel computes."""
        if type(layer) is not nn.QuantizedLinear or layer.mode != "affine":
            return False
        if layer.bits not in BITS or layer.group_size not in GROUP_SIZES:
            return False
        scales = layer["scales"]
        in_dims = layer["weight"].shape[1] * 32 // layer.bits
        return (
            in_dims % LANE_VALUES == 0
            and scales.dtype in (mx.bfloat16, mx.float16)
            and layer.get("biases") is not None
            and layer["biases"].dtype == scales.dtype
        )

    @classmethod
    def like(cls, layer: nn.QuantizedLinear) -> FewRowQuantizedLinear:
        """A `FewRowQuantizedLinear` over `layer`'s own arrays (nothing is copied)."""
        # The smallest valid instance (its random init is one group); the arrays replace it.
        new = cls(layer.group_size, 1, bias="bias" in layer, group_size=layer.group_size,
                  bits=layer.bits, mode=layer.mode)  # fmt: skip
        for name, value in layer.items():
            setattr(new, name, value)
        new.freeze()
        return new

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not (available() and x.dtype == self["scales"].dtype):
            return super().__call__(x)
        arrays = (x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self["biases"])
        if 1 <= rows <= MAX_ROWS:
            y = few_row_quantized_matmul(*arrays, group_size=self.group_size, bits=self.bits)
        elif tensor_core_matmul.takes(rows, x.shape[-1], self.bits):
            y = tensor_core_matmul.tensor_core_quantized_matmul(*arrays, group_size=self.group_size)
        else:
            return super().__call__(x)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if "bias" in self:
            y = y + self["bias"]
        return y


def use_few_row_kernel(module: nn.Module) -> int:
    """Swap every eligible quantized linear map under `module` for a `FewRowQuantizedLinear`
    over the same arrays, in place; returns how many were swapped."""
    swapped = 0

    def swap(layer: nn.Module) -> nn.Module:
        nonlocal swapped
        if not FewRowQuantizedLinear.supports(layer):
            return layer
        swapped += 1
        return FewRowQuantizedLinear.like(layer)

    leaves = tree_map(swap, module.leaf_modules(), is_leaf=nn.Module.is_module)
    module.update_modules(leaves)
    return swapped


# One row count for each variant the kernels compile: the few-row kernel's per row count (1-3),
# the tensor-core kernel's per 8-row tile (4-8, 9-16, 17-24, 25-32).
VARIANT_ROWS = (1, 2, 3, 8, 16, 24, 32)


def build_kernel_variants(module: nn.Module) -> int:
    """Run, once, each kernel variant that the `FewRowQuantizedLinear` layers under `module`
    may take (one layer per quantization, `VARIANT_ROWS` rows of zeros); returns how many
    layers ran them. Nothing runs where the kernels do not (`available`).

    MLX compiles a CUDA kernel the first time it meets its template, which holds the row
    count: a step of a count not met before (the MTP head's pass over the pairs a plain run
    held back, a short last prefill chunk) would pay that compile, 1-2 s, on a user's request.
    Run once at load, the variants cost a few matmuls of one layer."""
    if not available():
        return 0
    seen: set[tuple[int, int, mx.Dtype]] = set()
    for _, layer in module.named_modules():
        if not isinstance(layer, FewRowQuantizedLinear):
            continue
        dtype = layer["scales"].dtype
        key = (layer.bits, layer.group_size, dtype)
        if key in seen:
            continue
        seen.add(key)
        width = layer["weight"].shape[1] * 32 // layer.bits
        mx.eval([layer(mx.zeros((rows, width), dtype=dtype)) for rows in VARIANT_ROWS])
    return len(seen)


def use_mlx_kernels(module: nn.Module) -> int:
    """Undo `use_few_row_kernel`: every `FewRowQuantizedLinear` under `module` back to an
    `nn.QuantizedLinear` over the same arrays, in place; returns how many were swapped."""
    swapped = 0

    def swap(layer: nn.Module) -> nn.Module:
        nonlocal swapped
        if not isinstance(layer, FewRowQuantizedLinear):
            return layer
        swapped += 1
        plain = nn.QuantizedLinear(
            layer.group_size, 1, bias="bias" in layer, group_size=layer.group_size,
            bits=layer.bits, mode=layer.mode,
        )  # fmt: skip
        for name, value in layer.items():
            setattr(plain, name, value)
        plain.freeze()
        return plain

    leaves = tree_map(swap, module.leaf_modules(), is_leaf=nn.Module.is_module)
    module.update_modules(leaves)
    return swapped
