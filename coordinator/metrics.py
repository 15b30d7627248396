"""The live view of the cluster, the coordinator's request counters, and their Prometheus form.

The dashboard (`/api/cluster`), `/health` and `/metrics` all read the same `ClusterView`, so
what an operator sees on the page and what Prometheus scrapes can never disagree. The view is
implemented by whoever tracks the nodes (heartbeats, step timings); this module only defines
its shape and renders it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from cluster.placement import Stage, shard_fields


@dataclass(frozen=True, slots=True)
class HopStatus:
    """The link a node streams to its successor over."""

    address: str  # the successor's host:port
    kind: str  # thunderbolt, ethernet, wifi, loopback, other
    rtt_ms: float  # measured round trip; 0 when the address was given, not measured
    measured: bool
    # Every address of the successor measured: (host:port, median round trip in ms, or None
    # where it did not answer), the chosen one among them.
    tried: tuple[tuple[str, float | None], ...] = ()
    # Failover: moves to another address (the last one's reason) and back to the best;
    # `degraded` while the hop runs over another address than `best_address`.
    failovers: int = 0
    failbacks: int = 0
    last_failover: str = ""
    degraded: bool = False
    best_address: str = ""


@dataclass(frozen=True, slots=True)
class CoordinatorLinkStatus:
    """One of the coordinator's own links to a node of the pipeline: `role` "steps" (its
    step stream to the head), "results" (the node's results back to it) or "control" (its
    heartbeat and other calls). `transport` "tcp" for the resumable streams, "grpc" for the
    control calls and for a stream that rides the node's gRPC channel (a node with no step
    port), which never moves. `node_address`: the node as `NodeStatus.address` names it.
    Failover as a hop's (`HopStatus`); `failed`: why no address of the node answers."""

    role: str
    node_id: str
    node_address: str
    transport: str
    address: str  # host:port the link runs over now
    kind: str = ""
    interface: str = ""
    best_address: str = ""
    degraded: bool = False
    failovers: int = 0
    failbacks: int = 0
    last_failover: str = ""
    failed: str = ""


@dataclass(frozen=True, slots=True)
class NodeStatus(Stage):
    """One pipeline stage as last heard from: its `Stage` (`shard` None on standby) and what
    the node reports."""

    up: bool
    # Seconds since the last heartbeat asked: the figures shown are the node's at or after
    # then (an answer that arrives late may have been read before the answer's own time).
    last_heartbeat_s: float
    memory_used_bytes: int
    memory_total_bytes: int
    step_latency_ms: float
    device: str
    weights_fraction: float | None = None  # a weights transfer to the node in progress
    hop: HopStatus | None = None  # to the successor; None on the tail
    # What `cluster bench` reads: the node's cumulative counters, the round trips of the
    # coordinator's heartbeat to it and of its own pings to its successor, its machine.
    steps_total: int = 0
    batches_total: int = 0
    busy_seconds_total: float = 0.0
    rtt_ms: float = 0.0
    next_hop_rtt_ms: float = 0.0
    chip: str = ""
    os: str = ""
    cpu_count: int = 0
    # The MTP depth the tail chose per step, cumulative (0 on other nodes): steps decided,
    # those at depth 0, the drafts chosen over them (`pb.NodeInfo.mtp_*`).
    mtp_steps_decided: int = 0
    mtp_steps_plain: int = 0
    mtp_drafts_chosen: int = 0
    # The conversation cache's share on the node: its prefix snapshots, their bytes, budget.
    prefix_snapshots: int = 0
    prefix_snapshot_bytes: int = 0
    prefix_budget_bytes: int = 0
    # The caches of the requests the node holds now (attention KV, GatedDeltaNet state, and on
    # the tail the MTP head's KV), and how many requests hold them.
    request_cache_bytes: int = 0
    running_requests: int = 0
    # MLX's memory on the node: arrays alive, freed buffers kept for reuse (bounded by the
    # node's cache limit), and the high-water mark since it started.
    mlx_active_bytes: int = 0
    mlx_cache_bytes: int = 0
    mlx_peak_bytes: int = 0
    # Where the node's recent decode steps went, ms by phase (queued, handoff, decode,
    # layers, encode, send: `pb.StepPhases`); empty before its first step.
    step_phases_ms: dict[str, float] = field(default_factory=dict)
    # Whether the node holds its Mac awake (a power assertion while its shard is loaded), and
    # what holds it or why nothing does (node.keep_awake).
    keeps_awake: bool = False
    keep_awake_note: str = ""
    # What the node's last load built ahead of the warm-up (cluster.decode.kernel_builds);
    # empty where kernels are not compiled at first use.
    kernel_builds: str = ""

    @property
    def hop_state(self) -> str:
        """The link to the successor: "measured", "given" (the cluster file's address),
        "measuring" (a placed node but the tail that reports no hop yet: the status was read
        while its shard loads and its successor's addresses are timed), "" where there is
        none (the tail, a standby node)."""
        if self.hop is not None:
            return "measured" if self.hop.measured else "given"
        return "measuring" if self.shard is not None and not self.shard.is_tail else ""


@dataclass(frozen=True, slots=True)
class ClusterStats:
    """Cluster-wide serving figures, over whatever window the view chooses."""

    tokens_per_s: float
    acceptance_rate: float  # accepted MTP drafts / drafted, 0 when nothing was drafted
    requests_in_flight: int
    requests_total: int
    errors_total: int
    model_id: str
    # The conversation (prefix) cache: requests that started from a snapshot, the prompt
    # tokens they did not prefill, and the prefixes every node holds now; the requests that
    # found none, by reason (cluster.decode.prefix_index.MISS_REASONS).
    prefix_cache_hits: int = 0
    prefix_cache_saved_tokens: int = 0
    prefix_cache_entries: int = 0
    prefix_cache_misses: dict[str, int] = field(default_factory=dict)
    # Requests continued on a new placement after a node loss, and those that could not be.
    replays_total: int = 0
    replays_failed: int = 0
    # The chunk of a prompt that arrives while others decode, and its changes so far
    # (cluster.decode.interleave).
    interleave_chunk_tokens: int = 0
    interleave_chunk_changes: int = 0


class ClusterView(Protocol):
    """What the HTTP layer may ask of the cluster: read-only and cheap (called per poll)."""

    def node_statuses(self) -> list[NodeStatus]:
        """The nodes in pipeline order, head first."""
        ...

    def stats(self) -> ClusterStats: ...

    def coordinator_links(self) -> list[CoordinatorLinkStatus]:
        """The coordinator's own links to the nodes, head first (none without a pipeline)."""
        ...


@dataclass(slots=True)
class RequestCounters:
    """Counters the HTTP layer bumps and a `ClusterView` reads back into `ClusterStats`.

    Plain ints, not locks: every increment happens on the coordinator's event loop.
    `errors_total` counts requests that failed on our side (5xx, including failures after a
    stream had started); requests refused as invalid or over capacity are `rejected_total`,
    because a client's bad request says nothing about the cluster's health.
    """

    requests_total: int = 0
    in_flight: int = 0
    errors_total: int = 0
    rejected_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0


def cluster_json(view: ClusterView) -> dict[str, object]:
    """The `/api/cluster` document: what the dashboard draws, in pipeline order."""
    nodes = view.node_statuses()
    return {
        "nodes": [_node_json(node) for node in nodes],
        "coordinator_links": [asdict(link) for link in view.coordinator_links()],
        "stats": asdict(view.stats()),
        "healthy": bool(nodes) and all(node.up for node in nodes),
    }


def _node_json(node: NodeStatus) -> dict[str, object]:
    """A node as `/api/cluster` has always shown it: the stage's shard flattened in its place
    (start, end, is_head, is_tail; [0, 0) on standby), then the status, then `hop_state`."""
    out: dict[str, object] = {}
    for key, value in asdict(node).items():
        if key == "shard":
            out.update(shard_fields(node.shard))
        else:
            out[key] = value
    return out | {"hop_state": node.hop_state}


def render_prometheus(
    view: ClusterView,
    counters: RequestCounters,
    *,
    requests_queued: int,
    requests_running: int,
) -> str:
    """The Prometheus text exposition (format 0.0.4) of the view and the counters.

    Latencies are exported in seconds, as Prometheus base units want, even though the
    view keeps milliseconds.
    """
    nodes = view.node_statuses()
    stats = view.stats()
    out = _Exposition()
    out.family("cluster_info", "gauge", "The served model.", [({"model": stats.model_id}, 1)])
    up = [(_node_labels(node), float(node.up)) for node in nodes]
    out.family("cluster_node_up", "gauge", "1 when the node answers heartbeats, else 0.", up)
    for name, help_text, value_of in _NODE_GAUGES:
        samples = [({"node": node.node_id}, value_of(node)) for node in nodes]
        out.family(name, "gauge", help_text, samples)
    _hop_families(out, [node for node in nodes if node.hop is not None])
    _coordinator_link_families(out, view.coordinator_links())
    cluster_values = {
        "cluster_tokens_per_second": stats.tokens_per_s,
        "cluster_mtp_acceptance_rate": stats.acceptance_rate,
        "cluster_requests_in_flight": stats.requests_in_flight,
        "cluster_requests_running": requests_running,
        "cluster_requests_queued": requests_queued,
        "cluster_requests": stats.requests_total,
        "cluster_errors": stats.errors_total,
        "cluster_requests_rejected": counters.rejected_total,
        "cluster_prompt_tokens": counters.prompt_tokens_total,
        "cluster_completion_tokens": counters.completion_tokens_total,
        "cluster_prefix_cache_hits": stats.prefix_cache_hits,
        "cluster_prefix_cache_saved_tokens": stats.prefix_cache_saved_tokens,
        "cluster_prefix_cache_entries": stats.prefix_cache_entries,
        "cluster_replays": stats.replays_total,
        "cluster_replays_failed": stats.replays_failed,
        "cluster_interleave_chunk_tokens": stats.interleave_chunk_tokens,
        "cluster_interleave_chunk_changes": stats.interleave_chunk_changes,
    }
    for name, (kind, help_text) in _CLUSTER_METRICS.items():
        out.family(name, kind, help_text, [({}, cluster_values[name])])
    misses = [({"reason": reason}, n) for reason, n in stats.prefix_cache_misses.items()]
    out.family(
        "cluster_prefix_cache_misses",
        "counter",
        "Requests that found no cached prefix, by reason: evicted, over_budget, retokenized "
        "(matched up to a few tokens before a cached end), repeat (no stored point before the "
        "prompt's end), never_stored.",
        misses,
    )
    return out.text()


_NODE_GAUGES: tuple[tuple[str, str, Callable[[NodeStatus], float]], ...] = (
    (
        "cluster_node_step_latency_seconds",
        "The node's latest pipeline step latency.",
        lambda node: node.step_latency_ms / 1000.0,
    ),
    (
        "cluster_node_heartbeat_age_seconds",
        "Seconds since the node's last heartbeat.",
        lambda node: node.last_heartbeat_s,
    ),
    ("cluster_node_memory_used_bytes", "Memory the node uses.", lambda n: n.memory_used_bytes),
    ("cluster_node_memory_total_bytes", "Memory the node has.", lambda n: n.memory_total_bytes),
    ("cluster_node_mlx_active_bytes", "MLX arrays alive.", lambda n: n.mlx_active_bytes),
    ("cluster_node_mlx_cache_bytes", "MLX freed buffers kept.", lambda n: n.mlx_cache_bytes),
    ("cluster_node_mlx_peak_bytes", "MLX memory high-water mark.", lambda n: n.mlx_peak_bytes),
    ("cluster_node_layers", "Decoder layers the node holds.", lambda node: node.num_layers),
    (
        "cluster_node_prefix_snapshots",
        "Conversation-cache snapshots the node holds.",
        lambda node: node.prefix_snapshots,
    ),
    (
        "cluster_node_prefix_snapshot_bytes",
        "Memory of the node's conversation-cache snapshots.",
        lambda node: node.prefix_snapshot_bytes,
    ),
    (
        "cluster_node_request_cache_bytes",
        "Memory of the caches (KV and GatedDeltaNet state) of the requests the node holds.",
        lambda node: node.request_cache_bytes,
    ),
    (
        "cluster_node_running_requests",
        "Requests whose caches the node holds.",
        lambda node: node.running_requests,
    ),
)

# name -> (type, help); counters are written with the `_total` suffix.
_CLUSTER_METRICS: dict[str, tuple[str, str]] = {
    "cluster_tokens_per_second": ("gauge", "Generated tokens per second."),
    "cluster_mtp_acceptance_rate": ("gauge", "Accepted / drafted MTP tokens."),
    "cluster_requests_in_flight": ("gauge", "Requests being generated."),
    "cluster_requests_running": ("gauge", "Requests holding an admission slot."),
    "cluster_requests_queued": ("gauge", "Requests waiting for an admission slot."),
    "cluster_requests": ("counter", "Generation requests received."),
    "cluster_errors": ("counter", "Requests that failed on the server side."),
    "cluster_requests_rejected": ("counter", "Requests refused as invalid or over capacity."),
    "cluster_prompt_tokens": ("counter", "Prompt tokens of admitted requests."),
    "cluster_completion_tokens": ("counter", "Tokens generated for clients."),
    "cluster_prefix_cache_hits": ("counter", "Requests started from a cached prefix."),
    "cluster_prefix_cache_saved_tokens": (
        "counter",
        "Prompt tokens not prefilled thanks to the prefix cache.",
    ),
    "cluster_prefix_cache_entries": ("gauge", "Prefixes cached on every node."),
    "cluster_replays": ("counter", "Requests replayed on a new placement after a node loss."),
    "cluster_replays_failed": ("counter", "Requests that lost their node and found no placement."),
    "cluster_interleave_chunk_tokens": (
        "gauge",
        "Tokens per prefill chunk of a prompt that arrives while others decode.",
    ),
    "cluster_interleave_chunk_changes": (
        "counter",
        "Changes of that chunk to keep the decoding requests' gaps within budget.",
    ),
}


def _hop_families(out: _Exposition, nodes: list[NodeStatus]) -> None:
    """Each hop's link: where it runs, whether that is its best address, how often it moved."""
    link = [({"node": n.node_id, "address": n.hop.address, "kind": n.hop.kind}, 1.0) for n in nodes]
    out.family(
        "cluster_hop_link", "gauge", "The address a node streams to its successor over.", link
    )
    degraded = [({"node": n.node_id}, float(n.hop.degraded)) for n in nodes]
    out.family(
        "cluster_hop_degraded", "gauge", "1 while a hop runs over a slower address.", degraded
    )
    failovers = [({"node": n.node_id}, n.hop.failovers) for n in nodes]
    out.family(
        "cluster_hop_failovers", "counter", "Moves of a hop to its next-best address.", failovers
    )
    failbacks = [({"node": n.node_id}, n.hop.failbacks) for n in nodes]
    out.family("cluster_hop_failbacks", "counter", "Moves of a hop back to its best.", failbacks)


def _coordinator_link_families(out: _Exposition, links: list[CoordinatorLinkStatus]) -> None:
    """The coordinator's own links, as the hops' families show a hop's (`role`: steps,
    results, control), and the reason of each one's last failover."""
    labels = [{"role": link.role, "node": link.node_id} for link in links]
    where = [
        (label | {"address": link.address, "kind": link.kind, "transport": link.transport}, 1.0)
        for label, link in zip(labels, links, strict=True)
    ]
    out.family(
        "cluster_coordinator_link",
        "gauge",
        "The address each of the coordinator's links to a node runs over.",
        where,
    )
    out.family(
        "cluster_coordinator_link_degraded",
        "gauge",
        "1 while a coordinator link runs over a slower address than its best.",
        [(label, float(link.degraded)) for label, link in zip(labels, links, strict=True)],
    )
    out.family(
        "cluster_coordinator_link_failed",
        "gauge",
        "1 once no address of the node answers the coordinator's link.",
        [(label, float(bool(link.failed))) for label, link in zip(labels, links, strict=True)],
    )
    out.family(
        "cluster_coordinator_link_failovers",
        "counter",
        "Moves of a coordinator link to the node's next-best address.",
        [(label, link.failovers) for label, link in zip(labels, links, strict=True)],
    )
    out.family(
        "cluster_coordinator_link_failbacks",
        "counter",
        "Moves of a coordinator link back to its best address.",
        [(label, link.failbacks) for label, link in zip(labels, links, strict=True)],
    )
    reasons = [
        (label | {"reason": link.last_failover}, 1.0)
        for label, link in zip(labels, links, strict=True)
        if link.failovers
    ]
    out.family(
        "cluster_coordinator_link_last_failover_info",
        "gauge",
        "Why a coordinator link last moved to another address (1 per link that moved).",
        reasons,
    )


def _node_labels(node: NodeStatus) -> dict[str, str]:
    return {"node": node.node_id, "address": node.address, "device": node.device}


class _Exposition:
    """Builds the text format; counters get the `_total` suffix the format requires."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]],
    ) -> None:
        self._lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self._lines.append(f"# TYPE {name} {kind}")
        sample_name = f"{name}_total" if kind == "counter" else name
        for labels, value in samples:
            self._lines.append(f"{sample_name}{_labels(labels)} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{key}="{_escape_label(value)}"' for key, value in labels.items())
    return "{" + body + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
