"""GatedDeltaNet's recurrence over a step's positions as one CUDA kernel.

On MLX CUDA a decode step is bound by the host: MLX dispatches every primitive of the step's
graph on the calling thread, a few microseconds each. mlx-lm's recurrence on the ops path (CUDA
and the CPU; Metal has mlx-lm's own kernel) is some 27 primitives per position and layer even
compiled (slices, squeezes, expand_dims, two sums, fused elementwise kernels); this kernel is
one primitive whatever the step's length, and writes the states a rejected draft restores
(`snapshot_at`) as it passes them.

Its design: one warp per (request, value head, value column). Lane `i` holds the column's
state entries `[i * DK / 32, (i + 1) * DK / 32)` along the key axis in registers, so the
state is read once and written once per step. At each position the warp decays the state,
sums `state . k` by shuffles, writes the delta rule's update and sums `state . q` the same
way: mlx-lm's `_gated_delta_step_ops` in float32, the same arithmetic in another summation
order. Each position is computed alike whatever the step's length, so the first position of
a verify step equals the plain step of its token bit for bit (what keeps greedy decoding with
MTP identical to decoding without it).

It runs on CUDA (`available`), where a shard's `DecodeFastPath.recurrence_kernel`
(`cluster.model.fast_path`) asks for it. It takes key head dims that are multiples of 32 up to
256, value heads a multiple of the key heads, a float32 state, and snapshot points below 32;
anything else runs the ops (`takes`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

__all__ = ["available", "gated_delta_recurrence", "takes"]

WARPS_PER_BLOCK = 4  # value columns per block
MAX_SNAPSHOT_POSITION = 31  # snapshot points travel as the bits of one template constant

_HEADER = """
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}
"""

# Template constants: Y (the output dtype), DK (key head dim), SNAPS (bit t: keep the state
# from before position t in `snapshots`, in order). Inputs: q, k [B, T, Hk, DK], v [B, T, Hv,
# Dv], g (the decay) and beta [B, T, Hv], state [B, Hv, Dv, DK] float32. Outputs: y [B, T, Hv,
# Dv], state_out like state, snapshots [n, B, Hv, Dv, DK] (a placeholder when SNAPS is 0).
_SOURCE = """
  constexpr int PER_LANE = DK / 32;
  const int lane = threadIdx.x;
  const int column = blockIdx.y * blockDim.y + threadIdx.y;
  const int head_row = blockIdx.z;  // request * Hv + value head
  const int length = q_shape[1];
  const int k_heads = q_shape[2];
  const int v_heads = v_shape[2];
  const int v_dim = v_shape[3];
  if (column >= v_dim) {
    return;  // the whole warp: one column each
  }
  const int request = head_row / v_heads;
  const int v_head = head_row % v_heads;
  const int k_head = v_head / (v_heads / k_heads);
  const size_t at = (size_t(head_row) * v_dim + column) * DK + lane * PER_LANE;
  const size_t state_size = size_t(state_shape[0]) * v_heads * v_dim * DK;

  float s[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    s[i] = state[at + i];
  }
  int kept = 0;
  for (int t = 0; t < length; ++t) {
    if (t < 32 && (SNAPS & (1u << t))) {  // no shift past the constant's bits
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        snapshots[kept * state_size + at + i] = s[i];
      }
      ++kept;
    }
    const size_t qk = ((size_t(request) * length + t) * k_heads + k_head) * DK + lane * PER_LANE;
    const size_t gate = (size_t(request) * length + t) * v_heads + v_head;
    const size_t value = gate * v_dim + column;
    const float decay = static_cast<float>(g[gate]);
    const float rate = static_cast<float>(beta[gate]);
    float key[PER_LANE];
    float memory = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      key[i] = static_cast<float>(k[qk + i]);
      s[i] *= decay;
      memory += s[i] * key[i];
    }
    memory = warp_sum(memory);
    const float delta = (static_cast<float>(v[value]) - memory) * rate;
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      s[i] += key[i] * delta;
      out += s[i] * static_cast<float>(q[qk + i]);
    }
    out = warp_sum(out);
    if (lane == 0) {
      y[value] = static_cast<Y>(out);
    }
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    state_out[at + i] = s[i];
  }
"""


def available() -> bool:
    """Whether the kernel can run here: MLX on CUDA."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def takes(q: mx.array, v: mx.array, state: mx.array, snapshot_at: tuple[int, ...]) -> bool:
    """Whether the kernel runs here and computes this recurrence (shapes as in
    `gated_delta_recurrence`)."""
    length, k_heads, k_dim = q.shape[1:]
    return (
        available()
        and k_dim % 32 == 0
        and k_dim <= 256
        and v.shape[2] % k_heads == 0
        and state.dtype == mx.float32
        and q.dtype in (mx.bfloat16, mx.float16, mx.float32)
        and all(0 <= p < min(length, MAX_SNAPSHOT_POSITION + 1) for p in snapshot_at)
    )


@functools.cache
def _kernel() -> Callable:
    return mx.fast.cuda_kernel(
        name="gated_delta_recurrence",
        input_names=["q", "k", "v", "g", "beta", "state"],
        output_names=["y", "state_out", "snapshots"],
        source=_SOURCE,
        header=_HEADER,
    )


def gated_delta_recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    snapshot_at: tuple[int, ...] = (),
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """mlx-lm's gated delta recurrence over every position of `q`, `k` [B, T, Hk, Dk] and
    `v` [B, T, Hv, Dv] with the decay `g` and rates `beta` [B, T, Hv], from `state` [B, Hv,
    Dv, Dk] (float32). Returns (y [B, T, Hv, Dv] in q's dtype, the state after the last
    position, and for each `keep` in `snapshot_at` (ascending) the state after the first
    `keep` positions). CUDA only; callers check `takes` first."""
    batch, length, _, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    snaps = 0
    for keep in snapshot_at:
        snaps |= 1 << keep
    columns = -(-v_dim // WARPS_PER_BLOCK) * WARPS_PER_BLOCK
    y, state, snapshots = _kernel()(
        inputs=[q, k, v, g, beta, state],
        template=[("Y", q.dtype), ("DK", k_dim), ("SNAPS", snaps)],
        grid=(32, columns, batch * v_heads),
        threadgroup=(32, WARPS_PER_BLOCK, 1),
        output_shapes=[(batch, length, v_heads, v_dim), state.shape,
                       (len(snapshot_at), *state.shape) if snapshot_at else (1,)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )  # fmt: skip
    return y, state, [snapshots[i] for i in range(len(snapshot_at))]
