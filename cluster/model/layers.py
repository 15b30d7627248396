"""Qwen3.5 decoder layers over a packed batch of requests.

A step on a node may carry several requests at once (continuous batching). Their positions
are packed along the sequence axis into one `[1, L, hidden]` tensor: the projections, norms
and MLP run once over all of them (that is where the weights are read, so that is what
batching saves). The token mixers keep one cache per request. Requests whose steps have the
same shape (every decode step, typically) run their GatedDeltaNet recurrence as one batch, the
states stacked along the batch axis and left there for the next step (`BatchRow`), and their
attention as one call over their rows of one key-value buffer (`cluster.model.kv_slab`).

The modules extend mlx-lm's `qwen3_5` classes, so parameters, weight names and quantization
are exactly mlx-lm's; only the call changes. The GatedDeltaNet call adds the `n_confirmed`
split: positions from `n_confirmed` on are drafts, and the layer records its state after
each confirmed prefix so that a rejected draft can be undone by a restore.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.gated_delta import (
    _gated_delta_step_ops,
    compute_g,
    gated_delta_update,
    normalize_qk,
)
from mlx_lm.models.qwen3_5 import Attention, DecoderLayer, GatedDeltaNet, TextModelArgs

from cluster.model import gated_delta_kernel
from cluster.model.cache import RequestCache, batch_rows, stack_rows
from cluster.model.compiled_steps import MAX_COMPILED_POSITIONS, compile_bound
from cluster.model.fast_path import DecodeFastPath
from cluster.model.kv_slab import KVSlab, visible
from cluster.model.row_padding import pad_rows


@dataclass(frozen=True, slots=True)
class Segment:
    """One request's slice of a packed batch: `length` positions, the first `n_confirmed`
    of them confirmed tokens and the rest drafts."""

    cache: RequestCache
    length: int
    n_confirmed: int


def _split(x: mx.array, segments: list[Segment]) -> list[mx.array]:
    if len(segments) == 1:
        return [x]
    out, start = [], 0
    for seg in segments:
        out.append(x[:, start : start + seg.length])
        start += seg.length
    return out


def _length(segments: list[Segment]) -> int:
    """The step's real rows: a padded stream (`cluster.model.row_padding`) has more."""
    return sum(seg.length for seg in segments)


def _real(x: mx.array, length: int) -> mx.array:
    """The real rows of a possibly padded [1, rows, ...] tensor."""
    return x if x.shape[1] == length else x[:, :length]


def _row(x: mx.array, row: int) -> mx.array:
    """Request `row`'s slice [1, ...] of a batch-major tensor [B, ...]."""
    return x if x.shape[0] == 1 else x[row : row + 1]


def _join(parts: list[mx.array]) -> mx.array:
    """Per-request pieces [1, n, ...] back into one packed [1, L, ...] tensor."""
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


@dataclass(frozen=True, slots=True)
class CoreStep:
    """What `gdn_core` takes as constants (hashable: a compiled call is traced per value):
    `dims` (key heads, value heads, key head dim, value head dim), the step's `snapshot_at`
    (record the state after each of these prefixes) and whether the recurrence runs the
    backend's fused `kernel`."""

    dims: tuple[int, int, int, int]
    snapshot_at: tuple[int, ...]
    kernel: bool


@functools.lru_cache(maxsize=1024)
def core_step(
    dims: tuple[int, int, int, int], length: int, n_confirmed: int, kernel: bool
) -> CoreStep:
    """The `CoreStep` of a step of `length` positions, the first `n_confirmed` confirmed: the
    state is recorded after each confirmed prefix, which a rejected draft restores. Made once
    per shape and shared by every layer."""
    return CoreStep(dims, tuple(range(n_confirmed, length)), kernel)


class PackedGatedDeltaNet(GatedDeltaNet):
    # The shard's choice (`PackedDecoderLayer.use_fast_path`); the plain ops until given one.
    fast_path = DecodeFastPath()

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """qkv, z, b, a of the packed input."""
        if "in_proj" in self:  # fused at load (cluster.model.fused)
            return tuple(self.in_proj(x))
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def __call__(self, x: mx.array, segments: list[Segment], slot: int) -> mx.array:
        rows, length = x.shape[1], _length(segments)  # rows > length: padded (row_padding)
        qkv, z, b, a = (_real(t, length) for t in self.project(x))
        z = z.reshape(1, length, self.num_v_heads, self.head_v_dim)
        mixed: list[mx.array | None] = [None] * len(segments)
        # Requests whose steps have the same shape (every decode step, typically) run their
        # recurrence as one batch: the states stack along the batch axis.
        for shape, members in _group_by_shape(segments).items():
            parts = [_stack(t, segments, members) for t in (qkv, a, b)]
            out = self._mix(*parts, [segments[i] for i in members], *shape, slot)
            for row, i in enumerate(members):
                mixed[i] = out[row : row + 1] if len(members) > 1 else out
        out = self.norm(_join(mixed), z)
        return self.out_proj(pad_rows(out.reshape(1, length, -1), rows))

    def _mix(
        self,
        qkv: mx.array,
        a: mx.array,
        b: mx.array,
        segs: list[Segment],
        length: int,
        n_confirmed: int,
        slot: int,
    ) -> mx.array:
        conv_state, state = self.states(segs, slot, qkv.dtype)
        fast = self.fast_path
        weights = (self.conv1d.weight, self.A_log, self.dt_bias)
        compiled = fast.compiled_steps if len(segs) == 1 else fast.compiled_batches
        if compiled and length <= MAX_COMPILED_POSITIONS:
            step = core_step(self.dims, length, n_confirmed, fast.recurrence_kernel)
            out, *new_states = compile_bound(gdn_core, step=step)(
                qkv, a, b, conv_state, state, weights
            )
        else:
            kernel = fast.recurrence_kernel and not self.training
            step = core_step(self.dims, length, n_confirmed, kernel)
            out, *new_states = gdn_core(qkv, a, b, conv_state, state, weights, step=step)
        self.store(segs, slot, step.snapshot_at, new_states)
        return out

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def states(self, segs: list[Segment], slot: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """The segments' conv and recurrent states, stacked along the batch axis."""
        caches = [seg.cache.layers[slot] for seg in segs]
        n_keep = self.conv_kernel_size - 1
        conv_state = stack_rows([c[0] for c in caches], (1, n_keep, self.conv_dim), dtype)
        state_shape = (1, self.num_v_heads, self.head_v_dim, self.head_k_dim)
        return conv_state, stack_rows([c[1] for c in caches], state_shape, mx.float32)

    @staticmethod
    def store(
        segs: list[Segment], slot: int, snapshot_at: tuple[int, ...], states: list[mx.array]
    ) -> None:
        """`gdn_core`'s new states (conv, recurrent, then the snapshots) into the caches, each
        request's as its row of the batch's arrays (`cluster.model.cache.BatchRow`)."""
        conv, state, *snapshots = states
        n_snap = len(snapshot_at)
        for i, keep in enumerate(snapshot_at):
            snap_convs, afters = batch_rows(snapshots[i]), batch_rows(snapshots[n_snap + i])
            for seg, snap_conv, after in zip(segs, snap_convs, afters, strict=True):
                seg.cache.record_snapshot(slot, keep, snap_conv, after)
        for seg, conv_row, state_row in zip(segs, batch_rows(conv), batch_rows(state), strict=True):
            cache = seg.cache.layers[slot]
            cache[0], cache[1] = conv_row, state_row


def gdn_core(
    qkv: mx.array,
    a: mx.array,
    b: mx.array,
    conv_state: mx.array,
    state: mx.array,
    weights: tuple[mx.array, mx.array, mx.array],
    *,
    step: CoreStep,
) -> tuple[mx.array, ...]:
    """GatedDeltaNet between its projections, as a function of arrays alone (so that it can be
    compiled, `cluster.model.compiled_steps`): the causal conv over the conv state and the
    step's `qkv`, q/k normalization, the gated delta recurrence. `weights` are the layer's
    (conv1d weight, A_log, dt_bias). Returns (out [B, L, Hv, Dv], the new conv state, the new
    recurrent state, the conv state after each `step.snapshot_at` prefix, the recurrent state
    after each)."""
    conv_weight, A_log, dt_bias = weights
    n_k, n_v, d_k, d_v = step.dims
    batch, length, conv_dim = qkv.shape
    n_keep = conv_state.shape[1]
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    # nn.Conv1d's call, with mlx-lm's depthwise settings (stride 1, no padding).
    conv_out = nn.silu(mx.conv1d(conv_input, conv_weight, 1, 0, 1, conv_dim))
    key_dim = n_k * d_k
    q, k, v = (
        t.reshape(batch, length, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [key_dim, 2 * key_dim], -1),
            [n_k, n_k, n_v],
            [d_k, d_k, d_v],
            strict=True,
        )
    )
    q, k = normalize_qk(q, k, inv_scale=d_k**-0.5, eps=1e-6)
    out, state, snap_states = _recurrence(q, k, v, a, b, (A_log, dt_bias), state, step)
    snap_convs = [conv_input[:, keep : keep + n_keep] for keep in step.snapshot_at]
    conv = mx.contiguous(conv_input[:, -n_keep:])
    return out, conv, state, *snap_convs, *snap_states


def _recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    decay: tuple[mx.array, mx.array],
    state: mx.array,
    step: CoreStep,
) -> tuple[mx.array, mx.array, list[mx.array]]:
    """mlx-lm's gated delta recurrence over all positions, with the layer's `decay` parameters
    (A_log, dt_bias). Returns (out, the state after the last position, the state after the
    first `keep` positions for each `keep` in `step.snapshot_at`, in that order).

    `step.kernel` takes the backend's fused kernel where there is one. With Metal's (mlx-lm's)
    the sequence runs in pieces that end at the snapshot points; CUDA's
    (`cluster.model.gated_delta_kernel`) writes the snapshots as it passes them. The ops path
    (the CPU, or no kernel) steps one position at a time anyway, so it runs mlx-lm's own step
    function in one loop and picks the states up as they pass: no extra work for a draft.
    """
    A_log, dt_bias = decay
    snapshot_at = step.snapshot_at
    length = q.shape[1]
    if step.kernel and mx.default_device() == mx.gpu and mx.metal.is_available():
        snapshots = []
        outs, begin = [], 0
        for keep in [*snapshot_at, length]:
            out, state = gated_delta_update(
                q[:, begin:keep], k[:, begin:keep], v[:, begin:keep], a[:, begin:keep],
                b[:, begin:keep], A_log, dt_bias, state, None,
            )  # fmt: skip
            outs.append(out)
            if keep < length:
                snapshots.append(state)
            begin = keep
        return (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)), state, snapshots
    beta = mx.sigmoid(b)
    g = compute_g(A_log, a, dt_bias)
    if step.kernel and gated_delta_kernel.takes(q, v, state, snapshot_at):
        return gated_delta_kernel.gated_delta_recurrence(q, k, v, g, beta, state, snapshot_at)
    if (repeat := v.shape[-2] // q.shape[-2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys, snapshots = [], []
    for t in range(length):
        if t in snapshot_at:
            snapshots.append(state)
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state, snapshots


def _group_by_shape(segments: list[Segment]) -> dict[tuple[int, int], list[int]]:
    groups: dict[tuple[int, int], list[int]] = {}
    for i, seg in enumerate(segments):
        groups.setdefault((seg.length, seg.n_confirmed), []).append(i)
    return groups


def _stack(x: mx.array, segments: list[Segment], members: list[int]) -> mx.array:
    """The members' slices of packed `x` [1, L, d], stacked along the batch axis."""
    length = segments[members[0]].length
    if len(members) == len(segments):  # all of the batch, in order: a free reshape
        return x.reshape(len(members), length, *x.shape[2:])
    starts = list(itertools.accumulate((s.length for s in segments), initial=0))
    return mx.concatenate([x[:, starts[i] : starts[i] + length] for i in members], axis=0)


class PackedAttention(Attention):
    def __call__(self, x: mx.array, segments: list[Segment], slot: int) -> mx.array:
        rows, length = x.shape[1], _length(segments)  # rows > length: padded (row_padding)
        if "qkv_proj" in self:  # fused at load (cluster.model.fused)
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (_real(t, length) for t in (q, k, v))
        queries, gate = mx.split(q.reshape(1, length, self.num_attention_heads, -1), 2, axis=-1)
        keys = self.k_norm(k.reshape(1, length, self.num_key_value_heads, -1))
        values = v.reshape(1, length, self.num_key_value_heads, -1)
        queries = self.q_norm(queries)
        if len({seg.length for seg in segments}) == 1:
            mixed = self._attend(queries, keys, values, segments, slot)
        else:
            parts = zip(
                _split(queries, segments),
                _split(keys, segments),
                _split(values, segments),
                segments,
                strict=True,
            )
            mixed = _join([self._attend(q, k, v, [seg], slot) for q, k, v, seg in parts])
        out = mixed * mx.sigmoid(gate.reshape(1, length, -1))
        return self.o_proj(pad_rows(out, rows))

    def _attend(
        self, q: mx.array, k: mx.array, v: mx.array, segments: list[Segment], slot: int
    ) -> mx.array:
        """Attention for requests whose steps have one length (every decode step, typically):
        the layout and the rotary embedding run once for them all, each row at its own offset,
        and so do the cache write and the attention, over their rows of one `KVSlab`, once the
        same requests have stepped together before (`KVSlab.steady`); until then per request."""
        batch, length = len(segments), segments[0].length
        if batch > 1:
            q, k, v = (t.reshape(batch, length, *t.shape[2:]) for t in (q, k, v))
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        caches = [seg.cache.layers[slot] for seg in segments]
        deferred = [seg.cache.deferred for seg in segments]
        if deferred[0] is not None:  # a step built before the last one's verdict was read
            offset = deferred[0].verdicts.offsets(
                tuple(d.row for d in deferred), tuple(c.offset for c in caches)
            )
        elif batch == 1:
            offset = caches[0].offset
        else:
            offset = _offsets(tuple(c.offset for c in caches))
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if batch > 1 and KVSlab.steady(caches):  # one write and one attention call for them all
            held_at = tuple(c.offset for c in caches)
            keys, values = KVSlab.of(caches, k, v).write(k, v, held_at)
            for cache in caches:
                cache.offset += length
            if deferred[0] is None:
                mask = visible(held_at, length)
            else:
                rows = tuple(d.row for d in deferred)
                holes = tuple(d.hole_end for d in deferred)
                mask = deferred[0].verdicts.visible(rows, holes, held_at, length)
            out = scaled_dot_product_attention(
                q, keys, values, cache=caches[0], scale=self.scale, mask=mask
            )
            return out.transpose(0, 2, 1, 3).reshape(1, batch * length, -1)
        outs = []
        for row, (cache, held) in enumerate(zip(caches, deferred, strict=True)):
            mask = "causal" if length > 1 else None
            if held is not None and held.verdicts.undecided[held.row]:
                mask = held.verdicts.mask(held.row, held.hole_end, length)
            keys, values = cache.update_and_fetch(_row(k, row), _row(v, row))
            outs.append(
                scaled_dot_product_attention(
                    _row(q, row), keys, values, cache=cache, scale=self.scale, mask=mask
                )
            )
        out = outs[0] if batch == 1 else mx.concatenate(outs, axis=0)
        return out.transpose(0, 2, 1, 3).reshape(1, batch * length, -1)


@functools.lru_cache(maxsize=16)
def _offsets(offsets: tuple[int, ...]) -> mx.array:
    """A batch's cache offsets as an array, made once per step for all its attention layers."""
    return mx.array(offsets)


class PackedDecoderLayer(DecoderLayer):
    """mlx-lm's Qwen3.5 decoder layer, with the packed mixers above."""

    def __init__(self, args: TextModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        # Replacing the mixers costs nothing: mlx-lm's were never evaluated.
        if self.is_linear:
            self.linear_attn = PackedGatedDeltaNet(args)
        else:
            self.self_attn = PackedAttention(args)

    # The shard's choice (`use_fast_path`); the plain ops until given one.
    fast_path = DecodeFastPath()

    def __call__(self, x: mx.array, segments: list[Segment], slot: int) -> mx.array:  # type: ignore[override]
        # A decode step of one request, or of a batch whose requests' steps share one shape:
        # one compiled call.
        if (
            self.is_linear
            and self.fast_path.compiled_layers
            and (shape := _one_shape(segments))
            and shape[0] <= MAX_COMPILED_POSITIONS
        ):
            return self._compiled_linear_step(x, segments, slot, *shape)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), segments, slot)
        return h + self.mlp(self.post_attention_layernorm(h))

    def use_fast_path(self, fast_path: DecodeFastPath, traces: LayerTraces) -> None:
        """Run the parts of the fast path that `fast_path` asks for, keeping compiled layer
        steps in `traces`, which all of a shard's layers share (their fast path is one)."""
        # Plain attributes, not module members: neither is a parameter.
        self.__dict__["fast_path"] = fast_path
        self.__dict__["_traces"] = traces
        for cached in ("_params", "_structure"):  # of the layer's modules, which may change
            self.__dict__.pop(cached, None)
        if self.is_linear:
            self.linear_attn.__dict__["fast_path"] = fast_path

    def _compiled_linear_step(
        self, x: mx.array, segments: list[Segment], slot: int, length: int, n_confirmed: int
    ) -> mx.array:
        """The whole GatedDeltaNet layer as one compiled call (`cluster.model.compiled_steps`):
        a graph replayed in C++ with its elementwise chains fused. The layer's weights are inputs
        of the trace, so the shard's layers of one structure (`LayerTraces`) replay one trace per
        (rows, drafts) shape, and a batch size seen for the first time costs one trace, not one
        per layer."""
        gdn = self.linear_attn
        conv_state, state = gdn.states(segments, slot, x.dtype)
        traces = self.__dict__.setdefault("_traces", LayerTraces())
        if (params := self.__dict__.get("_params")) is None:
            # Read once: a shard's weights do not change once it steps.
            params = self.__dict__["_params"] = self.parameters()
            self.__dict__["_structure"] = traces.structure_of(self)
        rows = len(segments) * length
        # The shard's fast path is fixed, so the kernels traced in are too: the structure (which
        # tells a few-row kernel's layer from MLX's) and the step's shape name the trace.
        core = core_step(gdn.dims, length, n_confirmed, self.fast_path.recurrence_kernel)
        key = (self.__dict__["_structure"], rows, length, n_confirmed)
        if (step := traces.steps.get(key)) is None:
            step = traces.steps[key] = mx.compile(
                functools.partial(_linear_layer_step, self, length=rows, step=core)
            )
        h, *new_states = step(params, x, conv_state, state)
        gdn.store(segments, slot, core.snapshot_at, new_states)
        return h


class LayerTraces:
    """A shard's compiled GatedDeltaNet layer steps. Layers of one structure (their modules'
    classes and settings, their parameters' shapes and dtypes) share a trace per step shape;
    a layer quantized otherwise than the rest (a mixed-precision checkpoint) gets its own."""

    def __init__(self) -> None:
        self.steps: dict[tuple, Callable[..., list[mx.array]]] = {}
        self._structures: dict[tuple, int] = {}

    def structure_of(self, layer: nn.Module) -> int:
        """A small number naming `layer`'s structure."""
        modules = tuple(
            (name, type(m).__name__, *(getattr(m, a, None) for a in ("bits", "group_size", "mode")))
            for name, m in layer.named_modules()
        )
        arrays = tuple((name, a.shape, a.dtype) for name, a in tree_flatten(layer.parameters()))
        return self._structures.setdefault((modules, arrays), len(self._structures))


def _one_shape(segments: list[Segment]) -> tuple[int, int] | None:
    """The (positions, confirmed) that every segment's step has, or None."""
    first = segments[0]
    shape = (first.length, first.n_confirmed)
    if all((seg.length, seg.n_confirmed) == shape for seg in segments):
        return shape
    return None


def _linear_layer_step(
    template: PackedDecoderLayer,
    params: dict,
    x: mx.array,
    conv_state: mx.array,
    state: mx.array,
    *,
    length: int,
    step: CoreStep,
) -> list[mx.array]:
    """The GatedDeltaNet decoder layer whose parameters are `params` over a batch of requests
    of one step shape, as a function of arrays, run through `template` (a layer of the same
    shard; it gets its own parameters back). Traced, `params` are the trace's inputs, so the
    trace holds no layer's weights and serves them all. The same ops as
    `PackedDecoderLayer.__call__` (all requests in one group, so the stacking and joining are
    reshapes). `length` is the step's real rows in all; `x` may have more
    (`cluster.model.row_padding`). Returns the layer's output, then `gdn_core`'s states."""
    held = template.parameters()
    template.update(params)
    try:
        gdn = template.linear_attn
        batch, rows = conv_state.shape[0], x.shape[1]
        qkv, z, b, a = (_real(t, length) for t in gdn.project(template.input_layernorm(x)))
        z = z.reshape(1, length, gdn.num_v_heads, gdn.head_v_dim)
        qkv, a, b = (t.reshape(batch, length // batch, *t.shape[2:]) for t in (qkv, a, b))
        weights = (gdn.conv1d.weight, gdn.A_log, gdn.dt_bias)
        out, *states = gdn_core(qkv, a, b, conv_state, state, weights, step=step)
        out = out.reshape(1, length, gdn.num_v_heads, gdn.head_v_dim)
        h = x + gdn.out_proj(pad_rows(gdn.norm(out, z).reshape(1, length, -1), rows))
        return [h + template.mlp(template.post_attention_layernorm(h)), *states]
    finally:
        template.update(held)
