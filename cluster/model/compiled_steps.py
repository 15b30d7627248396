"""`mx.compile` for the short, fixed-shape GatedDeltaNet steps of decoding, where it pays.

On MLX CUDA each op of a decode step costs host time twice (Python builds its graph node, the
backend launches one kernel for it), and the device runs those kernels one after the other.
GatedDeltaNet's recurrence on the ops path (CUDA, CPU; Metal has mlx-lm's fused kernel) is some
30 small ops per layer and position (on CUDA, one kernel since: `cluster.model.gated_delta_kernel`,
traced into these calls). Compiled, a layer's step is one call that replays a traced graph in
C++ with its elementwise chains fused into a few kernels. A compiled function is traced once
per input shape, so only steps of at most `MAX_COMPILED_POSITIONS` positions (decode, verify)
take this path: the whole GatedDeltaNet layer of one request or of a batch whose requests'
steps share a shape (`DecodeFastPath.compiled_layers`; the layer's weights are inputs of the
trace, so one trace per (rows, drafts) shape serves every layer of a shard that has the same
structure), or the recurrence alone (`compiled_steps` for one request, `compiled_batches` for
each group of a batch of mixed shapes). A prefill chunk runs the plain ops.

Which of these a shard runs is its `DecodeFastPath` (`cluster.model.fast_path`): on CUDA by
default, where a step's graph build is what bounds it; off on Metal (mlx-lm's fused Metal
kernel already runs the recurrence in one launch) and on the CPU (its compiler runs cost
seconds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

__all__ = ["MAX_COMPILED_POSITIONS", "compile_bound"]

# A step of more positions runs the plain ops: each shape costs a trace, and prefill chunks
# come in many lengths.
MAX_COMPILED_POSITIONS = 8


@functools.cache
def compile_bound(fn: Callable[..., Any], **constants: Any) -> Callable[..., Any]:
    """`fn` with `constants` bound (hashable: shapes, snapshot points), compiled once per
    distinct binding and shared by every layer that calls it with the same ones."""
    return mx.compile(functools.partial(fn, **constants))
