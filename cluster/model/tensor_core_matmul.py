"""A 4-bit quantized matmul for a batch's 4 to 32 rows, on the tensor cores, as one CUDA kernel.

A batch step of 8 requests multiplies 8 rows (16 with a draft each) by every weight matrix. MLX
CUDA's GEMM path for those rows takes about twice its one-row time when the matmuls run one
after the other, as a model's do, and the few-row kernel (`cluster.model.few_row_matmul`),
which does its sums on the CUDA cores, turns compute-bound from 4 rows on: a batch paid for its
rows well beyond the weights' reading. Here the weights are read once for all rows and multiplied on
the tensor cores (`mma.sync` m16n8k16, float accumulation), whose rate leaves a step of up to
32 rows bound by reading the weights, like one row's.

Its design:
- a block of `WARPS` warps computes 16 output columns for every row; each warp takes a share of
  the input axis (split-K: more warps in flight to keep enough weight loads outstanding), and
  the warps' sums meet in shared memory;
- a warp steps along the input axis 128 values at a time: each lane loads 16 bytes of 4-bit
  weights for each of its two output columns (four neighbouring lanes read a column's 64
  bytes), dequantizes them to 16-bit floats as MLX's own kernels do (`q * scale + bias`, the
  nibble made a float exactly by `0x4300 | q`, the bfloat16 `128 + q`, less 128), and feeds
  them to eight k16 steps per 8 rows. Which input a lane supplies at which k of the mma is a
  permutation of the input axis, the same for the weights and the rows, so the sum is too;
- the loads are what bounds it: each warp keeps `DEPTH` spans of weights, scales and biases in
  flight ahead of the one it multiplies, and reads its rows' inputs 16 bytes at a time (eight
  of them, two k16 steps: 8-byte loads, one per step, made a 16-row step cost half again an
  8-row one by their latency and count).

Each row's sums are formed in an order that does not depend on the other rows, but not in the
few-row kernel's or MLX's order: a row's output differs from theirs in the last bits, as MLX's
own kernels differ across row counts. CUDA only; 4-bit affine weights with groups of 32, 64
or 128, 2-byte float inputs of a width that is a multiple of 128, scales of the input's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

__all__ = ["MAX_ROWS", "MIN_ROWS", "takes", "tensor_core_quantized_matmul"]

# Below, the few-row kernel's CUDA-core sums are about as fast, and its rows are bit-identical
# across 1 to 3 rows: a verify step's first row equals the plain step's, which keeps greedy
# decoding with MTP identical to decoding without it.
MIN_ROWS = 4
MAX_ROWS = 32  # four 8-row tiles per warp
WARPS = 4  # per block, splitting the input axis
DEPTH = 2  # spans of weights in flight per warp
GROUP_SIZES = (32, 64, 128)
SPAN = 128  # inputs per step of a warp: the width must be a multiple

_HEADER = """
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, const uint32_t* b) {
#if IS_BF16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
"""

# `IS_BF16` picks the 16-bit float type; the source is compiled once per input dtype.
_PAIR = {
    True: """
#define IS_BF16 1
typedef __nv_bfloat162 pair_t;
// Two 4-bit values (the nibbles of `byte`) dequantized: q * scale + bias, both of a pair.
__device__ __forceinline__ uint32_t dequantized_pair(uint32_t byte, pair_t scale, pair_t bias) {
  uint32_t biased = 0x43004300u | (byte & 0xFu) | ((byte & 0xF0u) << 12);  // 128 + q
  pair_t q = __hsub2(*reinterpret_cast<pair_t*>(&biased), __floats2bfloat162_rn(128.f, 128.f));
  pair_t v = __hfma2(q, scale, bias);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ pair_t pair_of(float v) { return __floats2bfloat162_rn(v, v); }
""",
    False: """
#define IS_BF16 0
typedef __half2 pair_t;
__device__ __forceinline__ uint32_t dequantized_pair(uint32_t byte, pair_t scale, pair_t bias) {
  uint32_t biased = 0x58005800u | ((byte & 0xFu) << 3) | ((byte & 0xF0u) << 15);  // 128 + q
  pair_t q = __hsub2(*reinterpret_cast<pair_t*>(&biased), __floats2half2_rn(128.f, 128.f));
  pair_t v = __hfma2(q, scale, bias);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ pair_t pair_of(float v) { return __floats2half2_rn(v, v); }
""",
}

# Template constants: T (input dtype), TILES (8-row tiles), GROUP, WARPS (warps per block,
# splitting the input axis), DEPTH (spans of weights in flight ahead of the one multiplied).
# Inputs: x [R, K], w [N, K / 8] uint32, scales and biases [N, K / GROUP]. Output y [R, N]. One
# block per 16 output columns. The input axis goes in spans of 128: lane (g, t) loads 16 bytes
# (32 values) of weight rows g and g + 8 at span offset 32 t, so a row's 64 bytes are read by 4
# neighbouring lanes, and 16 bytes of each of its rows of x at a time. The mma's k index is a
# permutation of the input's: in k16 step j the lane supplies its values 4j .. 4j + 3 for both
# the weights and the rows of x, so the sum is the same.
_SOURCE = """
  const int rows = x_shape[0];
  const int k_in = x_shape[1];
  const int n_out = w_shape[0];
  const int k_words = w_shape[1];
  const int spans = k_in / 128;
  const int groups = k_in / GROUP;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int col0 = blockIdx.x * 16;
  const int m_lo = min(col0 + g, n_out - 1);  // past the end: computed, not written
  const int m_hi = min(col0 + g + 8, n_out - 1);
  const uint4* w_lo = reinterpret_cast<const uint4*>(w + size_t(m_lo) * k_words) + t;
  const uint4* w_hi = reinterpret_cast<const uint4*>(w + size_t(m_hi) * k_words) + t;
  const T* scales_lo = scales + size_t(m_lo) * groups;
  const T* scales_hi = scales + size_t(m_hi) * groups;
  const T* biases_lo = biases + size_t(m_lo) * groups;
  const T* biases_hi = biases + size_t(m_hi) * groups;

  float acc[TILES][4];
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  }
  const int begin = (spans * warp) / WARPS;
  const int end = (spans * (warp + 1)) / WARPS;
  // DEPTH spans of weights, scales and biases in flight: the loop multiplies one while the
  // loads of the next ones are outstanding (a span's own work is too short to hide one).
  uint4 lo_in[DEPTH], hi_in[DEPTH];
  T scale_lo_in[DEPTH], scale_hi_in[DEPTH], bias_lo_in[DEPTH], bias_hi_in[DEPTH];
#define LOAD_SPAN(slot, span)                              \
  {                                                        \
    const int group_ = ((span) * 128 + 32 * t) / GROUP;    \
    lo_in[slot] = w_lo[4 * (span)];                        \
    hi_in[slot] = w_hi[4 * (span)];                        \
    scale_lo_in[slot] = scales_lo[group_];                 \
    scale_hi_in[slot] = scales_hi[group_];                 \
    bias_lo_in[slot] = biases_lo[group_];                  \
    bias_hi_in[slot] = biases_hi[group_];                  \
  }
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    if (begin + d < end) LOAD_SPAN(d, begin + d);
  }
  for (int base = begin; base < end; base += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int span = base + d;
      if (span >= end) break;
      const uint4 lo = lo_in[d];
      const uint4 hi = hi_in[d];
      const pair_t s_lo = pair_of(static_cast<float>(scale_lo_in[d]));
      const pair_t b_lo = pair_of(static_cast<float>(bias_lo_in[d]));
      const pair_t s_hi = pair_of(static_cast<float>(scale_hi_in[d]));
      const pair_t b_hi = pair_of(static_cast<float>(bias_hi_in[d]));
      if (span + DEPTH < end) LOAD_SPAN(d, span + DEPTH);
      const int k0 = span * 128 + 32 * t;  // this lane's 32 inputs
      const uint32_t lo_words[4] = {lo.x, lo.y, lo.z, lo.w};
      const uint32_t hi_words[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int half = 0; half < 4; ++half) {  // k16 steps 2 half and 2 half + 1
        uint4 xs[TILES];  // 8 inputs of each row: the two steps' b fragments
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
          const int r = i * 8 + g;
          xs[i] = r < rows
              ? *reinterpret_cast<const uint4*>(x + size_t(r) * k_in + k0 + 8 * half)
              : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int odd = 0; odd < 2; ++odd) {
          const int shift = 16 * odd;
          uint32_t a[4];
          a[0] = dequantized_pair(lo_words[half] >> shift, s_lo, b_lo);
          a[1] = dequantized_pair(hi_words[half] >> shift, s_hi, b_hi);
          a[2] = dequantized_pair(lo_words[half] >> (shift + 8), s_lo, b_lo);
          a[3] = dequantized_pair(hi_words[half] >> (shift + 8), s_hi, b_hi);
#pragma unroll
          for (int i = 0; i < TILES; ++i) {
            uint32_t b[2] = {odd ? xs[i].z : xs[i].x, odd ? xs[i].w : xs[i].y};
            mma_16816(acc[i], a, b);
          }
        }
      }
    }
  }
#undef LOAD_SPAN

  // The warps' sums meet in shared memory; warp 0 adds them in warp order and writes.
  __shared__ float shared_acc[WARPS - 1][TILES * 4][32];
  if (warp > 0) {
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        shared_acc[warp - 1][i * 4 + j][lane] = acc[i][j];
      }
    }
  }
  __syncthreads();
  if (warp != 0) {
    return;
  }
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = acc[i][j];
#pragma unroll
      for (int other = 0; other < WARPS - 1; ++other) {
        v += shared_acc[other][i * 4 + j][lane];
      }
      const int r = i * 8 + 2 * t + (j & 1);
      const int m = col0 + g + (j >= 2 ? 8 : 0);
      if (r < rows && m < n_out) {
        y[size_t(r) * n_out + m] = static_cast<T>(v);
      }
    }
  }
"""


def takes(rows: int, width: int, bits: int) -> bool:
    """Whether a step of `rows` rows of `width` inputs through `bits`-bit weights runs here
    (the rest of the checks are `FewRowQuantizedLinear.supports`')."""
    return bits == 4 and MIN_ROWS <= rows <= MAX_ROWS and width % SPAN == 0


@functools.cache
def _kernel(bf16: bool) -> Callable:
    return mx.fast.cuda_kernel(
        name=f"tensor_core_quantized_matmul_{'bf16' if bf16 else 'f16'}",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_SOURCE,
        header=_PAIR[bf16] + _HEADER,
    )


def tensor_core_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    warps: int = WARPS,
    depth: int = DEPTH,
) -> mx.array:
    """`x @ dequantize(w).T` for `x` of shape [rows, K], `MIN_ROWS` <= rows <= `MAX_ROWS`,
    and 4-bit `w`, as `mx.quantized_matmul(x, w, scales, biases, transpose=True)` computes it
    (CUDA only). `warps` split the input axis in a block (the sums' order, so a row's output,
    depends on it; not on the other rows); `depth` is how many spans of weights each warp has
    in flight (the output does not depend on it)."""
    rows, width = x.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the tensor-core kernel takes 1 to {MAX_ROWS} rows, got {rows}")
    if x.dtype not in (mx.bfloat16, mx.float16) or scales.dtype != x.dtype:
        raise ValueError(f"the tensor-core kernel takes 2-byte floats, got {x.dtype}")
    if group_size not in GROUP_SIZES or width % SPAN or width != w.shape[1] * 8:
        raise ValueError(f"inputs of width {width} do not fit 4-bit weights of shape {w.shape}")
    if not (2 <= warps <= 32 and 1 <= depth <= 8):
        raise ValueError(
            f"the tensor-core kernel takes 2-32 warps, 1-8 spans deep: {warps}, {depth}"
        )
    n_out = w.shape[0]
    (y,) = _kernel(x.dtype == mx.bfloat16)(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("TILES", -(-rows // 8)), ("GROUP", group_size),
                  ("WARPS", warps), ("DEPTH", depth)],
        grid=(-(-n_out // 16) * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, n_out)],
        output_dtypes=[x.dtype],
    )  # fmt: skip
    return y
