"""`mx.compile` for the short, fixed-shape pieces of a decode step, where it pays.

On MLX CUDA each op of a decode step costs host time twice (Python builds its graph node, the
backend launches one kernel for it), and the device runs those kernels one after the other.
GatedDeltaNet's recurrence on the ops path (CUDA, CPU; Metal has mlx-lm's fused kernel) is some
30 small ops per layer and position (on CUDA, one kernel since: `cluster.model.gated_delta_kernel`,
traced into these calls). Compiled, a layer's step is one call that replays a traced graph in
C++ with its elementwise chains fused into a few kernels. A compiled function is
traced once per input shape, so only steps of a few positions (decode, verify) take this path:
the whole GatedDeltaNet layer of one request or of a batch whose requests' steps share a shape
(`layers_enabled`; the layer's weights are inputs of the trace, so one trace per (rows,
drafts) shape serves every layer of a shard that has the same structure), or, for a batch of
mixed shapes, each group's recurrence alone (`batches_enabled`). A prefill chunk runs the
plain ops.

Whether it is on is decided per backend (`enabled`): on for CUDA, where it took the 27B-shape
backbone's one-token graph build from 17.2 to 15.1 ms (BENCHMARKS.md, issue 10); off on Metal
(mlx-lm's fused Metal kernel already runs the recurrence in one launch) and on the CPU (not
measured to pay there; its compiler runs cost seconds). `set_enabled` overrides the choice
(the tests, the benchmark's A/B runs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

__all__ = [
    "MAX_COMPILED_POSITIONS", "batches_enabled", "compiled", "enabled", "layers_enabled",
    "set_batches_enabled", "set_enabled", "set_layers_enabled",
]  # fmt: skip

MAX_COMPILED_POSITIONS = 8  # a step of more positions runs the plain ops

_override: bool | None = None


def set_enabled(on: bool | None) -> None:
    """Force compiled steps on or off; None restores the per-backend default."""
    global _override
    _override = on


def enabled(positions: int) -> bool:
    if positions > MAX_COMPILED_POSITIONS:
        return False
    if _override is not None:
        return _override
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


_layers_override: bool | None = None


def set_layers_enabled(on: bool | None) -> None:
    """Force whole compiled GatedDeltaNet layers on or off; None: follow `enabled`."""
    global _layers_override
    _layers_override = on


def layers_enabled(positions: int) -> bool:
    """Whether a GatedDeltaNet layer's step of one request runs as one compiled call (the
    projections, the norms and the MLP too, not only the recurrence)."""
    if positions > MAX_COMPILED_POSITIONS:
        return False
    return enabled(positions) if _layers_override is None else _layers_override


_batches_override: bool | None = None


def set_batches_enabled(on: bool | None) -> None:
    """Force the compiled recurrence for batches of requests on or off; None: the default."""
    global _batches_override
    _batches_override = on


def batches_enabled(positions: int) -> bool:
    """Whether a batch of several requests runs its GatedDeltaNet recurrence (`gdn_core`) as
    one compiled call. Its trace is shared by every layer (weights are inputs, not constants)
    and made once per (requests, positions) shape, so batch sizes coming and going cost a
    trace each, not one per layer. On where compiled steps are (CUDA), for a small measured
    gain: 8 concurrent requests in one process (27B shape, H200, warm) decoded 152-193 tok/s
    in all with it, 141-172 without (BENCHMARKS.md, issue 10, runs J and K)."""
    if positions > MAX_COMPILED_POSITIONS:
        return False
    return enabled(positions) if _batches_override is None else _batches_override


@functools.cache
def compiled(fn: Callable[..., Any], **constants: Any) -> Callable[..., Any]:
    """`fn` with `constants` bound (hashable: shapes, snapshot points), compiled once per
    distinct binding and shared by every layer that calls it with the same ones."""
    return mx.compile(functools.partial(fn, **constants))
