"""Which node holds which layers: a pure function from (nodes, model footprint) to a plan.

Memory decides first, speed second (ARCHITECTURE.md, "Placement"):

1. A stage must fit: its layers' weights, the caches of those layers for `concurrency`
   requests of `context_tokens` each (a KV cache per full-attention layer, a fixed conv +
   recurrent state per GatedDeltaNet layer), with `prefix_cache` the conversation cache's
   snapshots (one per request at full context, so that every running conversation's next
   turn can start from its own: as many bytes again as the caches), and its extras
   (embed_tokens on the head; final norm, lm_head, MTP head, MTP KV cache and embed_tokens
   on the tail) within the node's free memory less SAFETY_MARGIN, which is left for
   activations, MLX scratch buffers and the OS. A request the coordinator admits never
   holds more than this (its prompt plus max_tokens is at most `context_tokens`, and at most
   `concurrency` run at once), so a node cannot run out of memory for caches.
2. Among the layouts that fit, the slowest stage sets the decode pace. A stage's time per
   step is the bytes it streams (its layers' weights, plus lm_head and the MTP layer on the
   tail) over its memory bandwidth; the split minimises the largest stage time.
3. The fewest nodes that fit are used, unless `use_all`: every hop adds latency, and
   pipeline decode pays latency, not bandwidth.

The search: for k = 1, 2, ... nodes, every k-subset and every choice of head and tail node
in it (middle nodes by decreasing memory; with near-uniform layers their order does not
matter); for each ordering, a bisection on the bottleneck time with a greedy split that
gives each stage as many layers as its memory and the time bound allow. The greedy is exact
for a fixed order because both bounds are monotone in a stage's layer range. Clusters too
large to enumerate fall back to a few candidate subsets (by memory, bandwidth, both).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.model.footprint import ModelFootprint
from cluster.model.shard import ShardSpec

SAFETY_MARGIN = 0.10  # of each node's free memory, never planned for
# A context found by `plan_longest_context` is a multiple of this: the positions a KV cache
# grows by (cluster.decode.runner.KV_ALLOCATION_STEP), so its last block is never cut short.
CONTEXT_STEP = 256
DEFAULT_BANDWIDTH_GBPS = 100.0
_MAX_ORDERINGS = 20_000  # above this, the subset search falls back to candidate subsets
_BISECTION_STEPS = 100


class PlacementError(ValueError):
    """The model does not fit the nodes as asked; the message says by how much."""


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What placement needs to know of a node. `bandwidth_gbps` is its memory bandwidth in
    GB/s (10^9 bytes per second), the proxy for its decode speed."""

    node_id: str
    address: str  # host:port; empty for a hypothetical node
    memory_free_bytes: int
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS

    def __post_init__(self) -> None:
        if not self.node_id:
            raise PlacementError("a node needs a non-empty node_id")
        if self.memory_free_bytes < 0:
            raise PlacementError(f"node {self.node_id}: free memory must be >= 0")
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise PlacementError(f"node {self.node_id}: bandwidth must be > 0")

    @property
    def usable_bytes(self) -> int:
        """Free memory less the safety margin: what placement may fill."""
        return int(self.memory_free_bytes * (1.0 - SAFETY_MARGIN))

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_gbps * 1e9


@dataclass(frozen=True, slots=True)
class Stage:
    """A pipeline stage: which node, reached at which address, holds which shard (layers
    [start, end) and the head/tail roles). The one declaration of that record: a planned
    stage (`PlacementStage`) and a reported one (`coordinator.metrics.NodeStatus`) extend it;
    the wire carries the shard as flat fields (`pb.ShardSpec`, `pb.LoadShardRequest`) and the
    JSON of `/api/cluster` as flat keys (`shard_fields`). `shard` is None for a node on
    standby: found, but holding no layers."""

    node_id: str
    address: str  # host:port; empty for a hypothetical node
    shard: ShardSpec | None

    @property
    def num_layers(self) -> int:
        """Decoder layers the stage holds; 0 on standby."""
        return self.shard.end - self.shard.start if self.shard else 0


def shard_fields(shard: ShardSpec | None) -> dict[str, int | bool]:
    """`shard` as the flat keys users read (`/api/cluster`, `cluster status`, the dashboard,
    `cluster bench`): a node on standby shows the empty range [0, 0) and no role, as it
    always has."""
    if shard is None:
        return {"start": 0, "end": 0, "is_head": False, "is_tail": False}
    return {
        "start": shard.start,
        "end": shard.end,
        "is_head": shard.is_head,
        "is_tail": shard.is_tail,
    }


@dataclass(frozen=True, slots=True)
class PlacementStage(Stage):
    """One node's share: its stage (never on standby: `shard` is set) plus the memory and
    time that stage costs."""

    weight_bytes: int  # layers + head/tail extras
    kv_bytes: int  # attention KV of every admitted request at full context (+ MTP's, tail)
    gdn_bytes: int  # GatedDeltaNet conv + recurrent state of every admitted request
    snapshot_bytes: int  # the conversation cache's budget on the node (0: no cache)
    stage_time_estimate: float  # seconds per decode step: bytes streamed / bandwidth
    memory_free_bytes: int

    def __post_init__(self) -> None:
        if self.shard is None:  # a plan places every stage it lists
            raise PlacementError(f"node {self.node_id}: a planned stage needs layers")

    @property
    def cache_bytes(self) -> int:
        """The running requests' caches: KV + GatedDeltaNet state."""
        return self.kv_bytes + self.gdn_bytes

    @property
    def required_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.snapshot_bytes


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """Stages in pipeline order (head first), and why they are so."""

    stages: tuple[PlacementStage, ...]
    reasons: list[str] = field(default_factory=list)
    context_tokens: int = 0
    concurrency: int = 1
    prefix_cache: bool = False

    @property
    def bottleneck_time(self) -> float:
        """Seconds per step of the slowest stage: the pace of a full pipeline."""
        return max(s.stage_time_estimate for s in self.stages)

    @property
    def latency_time(self) -> float:
        """Seconds for one step to cross every stage: the pace of a single request."""
        return sum(s.stage_time_estimate for s in self.stages)

    def format_table(self) -> str:
        """A fixed-width table of the stages, for `cluster plan` and the logs."""
        rows = [_TABLE_HEADER, *(_table_row(i, s) for i, s in enumerate(self.stages))]
        widths = [max(len(row[c]) for row in rows) for c in range(len(_TABLE_HEADER))]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        snapshots = "one snapshot per request" if self.prefix_cache else "no conversation cache"
        lines.append(
            f"bottleneck {self.bottleneck_time * 1e3:.3f} ms/step, "
            f"one request {self.latency_time * 1e3:.3f} ms/step "
            f"(context {self.context_tokens} tokens x {self.concurrency} requests, {snapshots})"
        )
        return "\n".join(lines)


_TABLE_HEADER = (
    "stage",
    "node",
    "address",
    "layers",
    "role",
    "weights",
    "KV",
    "GDN state",
    "snapshots",
    "total",
    "free",
    "used",
    "ms/step",
)


def _table_row(index: int, s: PlacementStage) -> tuple[str, ...]:
    shard = s.shard
    role = "+".join(r for r, on in (("head", shard.is_head), ("tail", shard.is_tail)) if on) or "-"
    used = s.required_bytes / s.memory_free_bytes if s.memory_free_bytes else math.inf
    return (
        str(index),
        s.node_id,
        s.address or "-",
        f"[{shard.start}, {shard.end})",
        role,
        format_bytes(s.weight_bytes),
        format_bytes(s.kv_bytes),
        format_bytes(s.gdn_bytes),
        format_bytes(s.snapshot_bytes),
        format_bytes(s.required_bytes),
        format_bytes(s.memory_free_bytes),
        f"{used:.0%}",
        f"{s.stage_time_estimate * 1e3:.3f}",
    )


def format_bytes(n: float) -> str:
    """Binary units, as macOS reports memory."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plan_placement(
    nodes: Sequence[NodeCapacity],
    model: ModelFootprint,
    *,
    context_tokens: int,
    concurrency: int,
    layers: Sequence[tuple[int, int]] | None = None,
    use_all: bool = False,
    prefix_cache: bool = False,
) -> PlacementPlan:
    """Assign contiguous layer ranges to nodes: memory first, then the slowest stage.

    Each node reserves the caches of `concurrency` requests of `context_tokens` each and,
    with `prefix_cache`, the conversation cache's snapshots (`PlacementStage.snapshot_bytes`,
    the budget the node is given). `layers` fixes the split (one half-open range per node,
    in the order of `nodes`); otherwise the nodes' order and split are chosen, with the
    fewest nodes that fit unless `use_all`. Raises PlacementError when nothing fits, with the
    bytes needed and offered.
    """
    _check_inputs(nodes, context_tokens, concurrency)
    costs = _Costs(model, context_tokens, concurrency, prefix_cache)
    if layers is not None:
        return _fixed_plan(nodes, costs, layers)
    return _searched_plan(nodes, costs, use_all)


def plan_longest_context(
    nodes: Sequence[NodeCapacity],
    model: ModelFootprint,
    *,
    max_context: int,
    concurrency: int,
    layers: Sequence[tuple[int, int]] | None = None,
    use_all: bool = False,
    prefix_cache: bool = False,
) -> PlacementPlan:
    """`plan_placement` at `max_context` tokens of context where that fits, else at the
    longest context that does (a multiple of CONTEXT_STEP): what a cluster serves when the
    user named no limit. Raises the PlacementError of `max_context` when not even
    CONTEXT_STEP tokens fit."""
    kwargs = {"concurrency": concurrency, "layers": layers, "use_all": use_all}
    try:
        return plan_placement(
            nodes, model, context_tokens=max_context, prefix_cache=prefix_cache, **kwargs
        )
    except PlacementError as error:
        longest = longest_context(
            nodes, model, max_context=max_context, prefix_cache=prefix_cache, **kwargs
        )
        if longest == 0:
            raise error from None
    return plan_placement(nodes, model, context_tokens=longest, prefix_cache=prefix_cache, **kwargs)


def longest_context(
    nodes: Sequence[NodeCapacity],
    model: ModelFootprint,
    *,
    max_context: int,
    concurrency: int,
    layers: Sequence[tuple[int, int]] | None = None,
    use_all: bool = False,
    prefix_cache: bool = False,
) -> int:
    """The longest context, at most `max_context` and otherwise a multiple of CONTEXT_STEP,
    that `plan_placement` fits on `nodes`; 0 when not even CONTEXT_STEP tokens fit. Memory
    only grows with the context, so a bisection finds it."""

    def fits(tokens: int) -> bool:
        try:
            plan_placement(
                nodes,
                model,
                context_tokens=tokens,
                concurrency=concurrency,
                layers=layers,
                use_all=use_all,
                prefix_cache=prefix_cache,
            )
        except PlacementError:
            return False
        return True

    if fits(max_context):
        return max_context
    lo, hi = 0, max_context // CONTEXT_STEP  # steps: lo fits (0 trivially), above hi not
    if hi * CONTEXT_STEP == max_context:
        hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CONTEXT_STEP):
            lo = mid
        else:
            hi = mid - 1
    return lo * CONTEXT_STEP


def _check_inputs(nodes: Sequence[NodeCapacity], context_tokens: int, concurrency: int) -> None:
    if not nodes:
        raise PlacementError("no nodes to place the model on")
    ids = [n.node_id for n in nodes]
    if dupes := sorted({i for i in ids if ids.count(i) > 1}):
        raise PlacementError(f"duplicate node ids: {', '.join(dupes)}")
    if context_tokens < 1:
        raise PlacementError(f"context_tokens must be >= 1, got {context_tokens}")
    if concurrency < 1:
        raise PlacementError(f"concurrency must be >= 1, got {concurrency}")


class _Costs:
    """Prefix sums over layers of the memory a stage holds and the bytes it streams."""

    def __init__(
        self, model: ModelFootprint, context_tokens: int, concurrency: int, prefix_cache: bool
    ) -> None:
        self.model = model
        self.context_tokens = context_tokens
        self.concurrency = concurrency
        self.prefix_cache = prefix_cache
        self.num_layers = model.num_layers
        self.weights = [0, *itertools.accumulate(model.layer_weight_bytes)]
        cache = [
            model.layer_cache_bytes(i, context_tokens=context_tokens, concurrency=concurrency)
            for i in range(model.num_layers)
        ]
        is_attention = model.layer_is_attention
        kv = [c if a else 0 for c, a in zip(cache, is_attention, strict=True)]
        self.kv = [0, *itertools.accumulate(kv)]
        self.gdn = [0, *itertools.accumulate(c - k for c, k in zip(cache, kv, strict=True))]
        self.cache = [0, *itertools.accumulate(cache)]
        # A snapshot per request at full context holds what the request's caches hold.
        self.copies = 2 if prefix_cache else 1
        self.memory = [w + self.copies * c for w, c in zip(self.weights, self.cache, strict=True)]
        self.mtp_cache = model.mtp_cache_bytes(
            context_tokens=context_tokens, concurrency=concurrency
        )

    def fixed_memory(self, is_head: bool, is_tail: bool) -> int:
        """What a stage holds besides its layers (a tail's snapshots carry the MTP cache)."""
        extra = self.model.extra_bytes(is_head=is_head, is_tail=is_tail)
        return extra + (self.copies * self.mtp_cache if is_tail else 0)

    @property
    def all_caches(self) -> int:
        """Every stage's caches and snapshots together."""
        return self.copies * (self.cache[-1] + self.mtp_cache)

    def fixed_read(self, is_tail: bool) -> int:
        return self.model.tail_read_bytes if is_tail else 0

    def stage(
        self, node: NodeCapacity, start: int, end: int, head: bool, tail: bool
    ) -> PlacementStage:
        """The stage `node` would be with layers [start, end)."""
        extra = self.model.extra_bytes(is_head=head, is_tail=tail)
        read = self.weights[end] - self.weights[start] + self.fixed_read(tail)
        kv = self.kv[end] - self.kv[start] + (self.mtp_cache if tail else 0)
        gdn = self.gdn[end] - self.gdn[start]
        return PlacementStage(
            node_id=node.node_id,
            address=node.address,
            shard=ShardSpec(start, end, is_head=head, is_tail=tail),
            weight_bytes=self.weights[end] - self.weights[start] + extra,
            kv_bytes=kv,
            gdn_bytes=gdn,
            snapshot_bytes=(self.copies - 1) * (kv + gdn),
            stage_time_estimate=read / node.bytes_per_second,
            memory_free_bytes=node.memory_free_bytes,
        )

    def total_required(self, n_nodes: int) -> int:
        """All layers, extras and caches; two or more nodes hold embed_tokens at both ends."""
        if n_nodes == 1:
            return self.memory[-1] + self.fixed_memory(is_head=True, is_tail=True)
        return (
            self.memory[-1]
            + self.fixed_memory(is_head=True, is_tail=False)
            + self.fixed_memory(is_head=False, is_tail=True)
        )


def _split(order: Sequence[NodeCapacity], costs: _Costs, max_time: float) -> list[int] | None:
    """Stage boundaries for `order` with every stage within memory and `max_time`, or None.

    Each stage takes as many layers as it may while leaving one for every later stage; no
    split that fits ends a stage further on, so none fits when this one does not.
    """
    n_layers, k = costs.num_layers, len(order)
    bounds, start = [0], 0
    for j, node in enumerate(order):
        head, tail = j == 0, j == k - 1
        memory_left = node.usable_bytes - costs.fixed_memory(head, tail)
        read_left = max_time * node.bytes_per_second - costs.fixed_read(tail)
        if memory_left < 0 or read_left < 0:
            return None
        by_memory = bisect.bisect_right(costs.memory, costs.memory[start] + memory_left) - 1
        by_time = bisect.bisect_right(costs.weights, costs.weights[start] + read_left) - 1
        end = min(by_memory, by_time, n_layers - (k - 1 - j))
        if end <= start or (tail and end < n_layers):
            return None
        bounds.append(end)
        start = end
    return bounds


def _best_split(
    order: Sequence[NodeCapacity], costs: _Costs
) -> tuple[float, list[PlacementStage]] | None:
    """The split of `order` whose slowest stage is fastest, by bisection on that time."""
    loose = _split(order, costs, math.inf)
    if loose is None:
        return None
    lo, hi = 0.0, max(s.stage_time_estimate for s in _stages(order, costs, loose))
    bounds = loose
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        if (tighter := _split(order, costs, mid)) is None:
            lo = mid
        else:
            hi, bounds = mid, tighter
    stages = _stages(order, costs, bounds)
    return max(s.stage_time_estimate for s in stages), stages


def _stages(
    order: Sequence[NodeCapacity], costs: _Costs, bounds: Sequence[int]
) -> list[PlacementStage]:
    k = len(order)
    return [
        costs.stage(node, bounds[j], bounds[j + 1], j == 0, j == k - 1)
        for j, node in enumerate(order)
    ]


def _orderings(subset: Sequence[NodeCapacity]) -> list[list[NodeCapacity]]:
    """Every choice of head and tail; the middle by decreasing memory, then bandwidth."""
    if len(subset) == 1:
        return [list(subset)]
    result = []
    for head, tail in itertools.permutations(subset, 2):
        middle = [n for n in subset if n is not head and n is not tail]
        middle.sort(key=lambda n: (-n.memory_free_bytes, -n.bandwidth_gbps))
        result.append([head, *middle, tail])
    return result


def _subsets(nodes: Sequence[NodeCapacity], k: int) -> list[tuple[NodeCapacity, ...]]:
    """Every k-subset, or for clusters too large to enumerate the top k by a few keys."""
    if math.comb(len(nodes), k) * max(1, k * (k - 1)) <= _MAX_ORDERINGS:
        return list(itertools.combinations(nodes, k))
    keys = (
        lambda n: n.memory_free_bytes,
        lambda n: n.bandwidth_gbps,
        lambda n: n.memory_free_bytes * n.bandwidth_gbps,
    )
    picks = {tuple(sorted(nodes, key=key, reverse=True)[:k]) for key in keys}
    return sorted(picks, key=lambda s: [nodes.index(n) for n in s])


def _searched_plan(nodes: Sequence[NodeCapacity], costs: _Costs, use_all: bool) -> PlacementPlan:
    sizes = [len(nodes)] if use_all else range(1, len(nodes) + 1)
    for k in sizes:
        if k > costs.num_layers:
            break
        best: tuple[tuple[float, float], list[PlacementStage]] | None = None
        for subset in _subsets(nodes, k):
            for order in _orderings(subset):
                found = _best_split(order, costs)
                if found is None:
                    continue
                bottleneck, stages = found
                key = (bottleneck, sum(s.stage_time_estimate for s in stages))
                if best is None or key < best[0]:
                    best = key, stages
        if best is not None:
            stages = best[1]
            reasons = _reasons(nodes, costs, stages, use_all)
            return _plan(costs, stages, reasons)
    raise PlacementError(_refusal(nodes, costs, use_all))


def _fixed_plan(
    nodes: Sequence[NodeCapacity], costs: _Costs, layers: Sequence[tuple[int, int]]
) -> PlacementPlan:
    _check_layers(layers, len(nodes), costs.num_layers)
    k = len(nodes)
    stages = [
        costs.stage(node, start, end, j == 0, j == k - 1)
        for j, (node, (start, end)) in enumerate(zip(nodes, layers, strict=True))
    ]
    for stage, node in zip(stages, nodes, strict=True):
        if stage.required_bytes > node.usable_bytes:
            over = stage.required_bytes - node.usable_bytes
            raise PlacementError(
                f"node {node.node_id}: layers [{stage.shard.start}, {stage.shard.end}) need "
                f"{format_bytes(stage.required_bytes)} ({stage.required_bytes} bytes: "
                f"{_stage_parts(stage)}) but it offers {format_bytes(node.usable_bytes)} "
                f"({node.usable_bytes} bytes, free memory less {SAFETY_MARGIN:.0%}): "
                f"{format_bytes(over)} ({over} bytes) over, for {_load_text(costs)}"
            )
    reasons = [
        "split given by --layers / layers=; nodes in the order given, head first",
        *_budget_reasons(costs, len(stages)),
        _bottleneck_reason(stages),
    ]
    return _plan(costs, stages, reasons)


def _check_layers(layers: Sequence[tuple[int, int]], n_nodes: int, n_layers: int) -> None:
    if len(layers) != n_nodes:
        raise PlacementError(f"{len(layers)} layer ranges for {n_nodes} nodes: need one per node")
    expected_start = 0
    for start, end in layers:
        if start != expected_start or end <= start:
            raise PlacementError(
                f"layer ranges {list(layers)} must be non-empty, contiguous, half-open "
                f"ranges covering [0, {n_layers}); [{start}, {end}) should start at "
                f"{expected_start} and end after it"
            )
        expected_start = end
    if expected_start != n_layers:
        raise PlacementError(
            f"layer ranges {list(layers)} end at {expected_start}; the model has {n_layers}"
        )


def _stage_parts(stage: PlacementStage) -> str:
    return (
        f"weights {stage.weight_bytes} + KV {stage.kv_bytes} + GatedDeltaNet state "
        f"{stage.gdn_bytes} + snapshots {stage.snapshot_bytes}"
    )


def _load_text(costs: _Costs) -> str:
    """What the caches are planned for, as the refusals say it."""
    snapshots = ", with a conversation snapshot each" if costs.prefix_cache else ""
    return f"{costs.concurrency} requests of {costs.context_tokens} tokens{snapshots}"


def _plan(costs: _Costs, stages: Sequence[PlacementStage], reasons: list[str]) -> PlacementPlan:
    return PlacementPlan(
        stages=tuple(stages),
        reasons=reasons,
        context_tokens=costs.context_tokens,
        concurrency=costs.concurrency,
        prefix_cache=costs.prefix_cache,
    )


def _budget_reasons(costs: _Costs, n_nodes: int) -> list[str]:
    m = costs.model
    n_attn = len(m.attention_layers)
    return [
        f"memory per node: free memory less a {SAFETY_MARGIN:.0%} safety margin "
        "(activations, MLX scratch buffers, the OS)",
        f"model needs {format_bytes(costs.total_required(n_nodes))} on {n_nodes} node(s): "
        f"layer weights {format_bytes(costs.weights[-1])}, "
        f"head extras {format_bytes(m.head_extra_bytes)}, "
        f"tail extras {format_bytes(m.tail_extra_bytes)}, caches "
        f"{format_bytes(costs.cache[-1] + costs.mtp_cache)} for {costs.concurrency} x "
        f"{costs.context_tokens} tokens (KV {m.kv_bytes_per_token} B/token on {n_attn} "
        f"attention layers + {m.mtp_layers} MTP; GatedDeltaNet state {m.gdn_state_bytes} "
        f"B/request on {m.num_layers - n_attn} layers)",
        (
            f"conversation cache: {format_bytes(costs.all_caches // 2)} of snapshots, one per "
            "request at full context, so that each running conversation's next turn can "
            "start from its own"
            if costs.prefix_cache
            else "no conversation cache: no snapshot memory reserved"
        ),
    ]


def _bottleneck_reason(stages: Sequence[PlacementStage]) -> str:
    slow = max(stages, key=lambda s: s.stage_time_estimate)
    return (
        f"slowest stage: {slow.node_id} (layers [{slow.shard.start}, {slow.shard.end})) at "
        f"{slow.stage_time_estimate * 1e3:.3f} ms/step; a stage's time is the bytes it "
        "streams per step over its memory bandwidth"
    )


def _reasons(
    nodes: Sequence[NodeCapacity],
    costs: _Costs,
    stages: Sequence[PlacementStage],
    use_all: bool,
) -> list[str]:
    k = len(stages)
    if use_all:
        count = f"all {k} nodes used, as asked"
    elif k == 1:
        count = f"one node is enough: {stages[0].node_id} holds the whole model"
    else:
        fewer = k - 1
        largest = sorted(nodes, key=lambda n: n.usable_bytes, reverse=True)[:fewer]
        offered = format_bytes(sum(n.usable_bytes for n in largest))
        needed = format_bytes(costs.total_required(fewer))
        which = "no single node" if fewer == 1 else f"no {fewer} nodes"
        count = (
            f"{k} nodes: the fewest that fit; {which} can hold the model (the largest "
            f"{'offers' if fewer == 1 else f'{fewer} offer'} {offered} of the {needed} needed, "
            "or no split of them fits)"
        )
    reasons = [count, *_budget_reasons(costs, k)]
    used = {s.node_id for s in stages}
    if unused := [n.node_id for n in nodes if n.node_id not in used]:
        reasons.append(f"not used: {', '.join(unused)} (fewer hops; use_all / --all-nodes)")
    if k > 1:
        reasons.append(
            f"head {stages[0].node_id} carries embed_tokens; tail {stages[-1].node_id} carries "
            f"the final norm, lm_head, MTP head and its KV cache "
            f"({format_bytes(costs.fixed_memory(is_head=False, is_tail=True))})"
        )
        reasons.append(
            "split balanced by memory bandwidth: each stage takes as many layers as its "
            "memory and the slowest stage's time allow"
        )
    reasons.append(_bottleneck_reason(stages))
    return reasons


def _refusal(nodes: Sequence[NodeCapacity], costs: _Costs, use_all: bool) -> str:
    needed = costs.total_required(len(nodes))
    offered = sum(n.usable_bytes for n in nodes)
    caches = costs.cache[-1] + costs.mtp_cache
    snapshots = costs.all_caches - caches
    what = (
        f"needs {format_bytes(needed)} ({needed} bytes: weights and extras "
        f"{needed - caches - snapshots}, caches {caches}, snapshots {snapshots}, for "
        f"{_load_text(costs)})"
    )
    who = f"node {nodes[0].node_id} offers" if len(nodes) == 1 else f"the {len(nodes)} nodes offer"
    have = f"{who} {format_bytes(offered)} ({offered} bytes, free memory less {SAFETY_MARGIN:.0%})"
    if needed > offered:
        over = needed - offered
        return (
            f"the model does not fit: it {what} but {have}: "
            f"{format_bytes(over)} ({over} bytes) over"
        )
    largest_layer = max(costs.memory[i + 1] - costs.memory[i] for i in range(costs.num_layers))
    largest_node = max(n.usable_bytes for n in nodes)
    detail = (
        f"largest layer with its caches {format_bytes(largest_layer)}, tail extras "
        f"{format_bytes(costs.fixed_memory(False, True))}, largest node "
        f"{format_bytes(largest_node)}"
    )
    if use_all and len(nodes) > costs.num_layers:
        detail += f"; {len(nodes)} nodes for {costs.num_layers} layers"
    return f"no contiguous split fits: the model {what}; {have}, but {detail}"
