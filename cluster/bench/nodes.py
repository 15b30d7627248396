"""Per node, where a scenario's time went: from the nodes' own counters, via the coordinator.

The bench reads `/api/cluster` before and after each scenario. Each node counts the step
batches it computed and their compute time (`batches_total`, `busy_seconds_total`), so over
the scenario:

  step_ms      compute time / batches: one pass over the node's layers
  busy_share   compute time / the scenario's wall time: near 1 means this node sets the pace
  hop_rtt_ms   the round trip of the link into the node: the previous node's pings to it,
               or for the head the coordinator's heartbeat (the return from the tail to the
               coordinator is that node's `coordinator_rtt_ms`)

The busiest node (highest busy share) is the bottleneck; a slow hop shows in `hop_rtt_ms`.

The tail also counts the MTP depth it chose for each step of its requests (`DEPTH_COUNTERS`,
0 on the other nodes); each row carries their differences, from which `metrics.chosen_depth`
makes the scenario's mean depth and share of steps at depth 0.
"""

from __future__ import annotations

from typing import Any

NodeSnapshot = dict[str, dict[str, Any]]  # node id -> its /api/cluster entry
# Cumulative on the tail: steps whose next depth it chose, those at depth 0, drafts chosen.
DEPTH_COUNTERS = ("mtp_steps_decided", "mtp_steps_plain", "mtp_drafts_chosen")


def pipeline_nodes(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes holding layers, head first (standby nodes left out)."""
    placed = [n for n in cluster.get("nodes", []) if n["end"] > n["start"]]
    return sorted(placed, key=lambda n: n["start"])


def snapshot(cluster: dict[str, Any]) -> NodeSnapshot:
    return {n["node_id"]: n for n in pipeline_nodes(cluster)}


def hardware(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pipeline node's machine as it reports it."""
    return [
        {
            "node_id": n["node_id"],
            "address": n["address"],
            "layers": [n["start"], n["end"]],
            "chip": n.get("chip", ""),
            "os": n.get("os", ""),
            "cpu_count": n.get("cpu_count", 0),
            "memory_total_bytes": n["memory_total_bytes"],
            "device": n["device"],
            "hop": n.get("hop"),  # the link to its successor: where the pipeline streams
        }
        for n in pipeline_nodes(cluster)
    ]


def breakdown(before: NodeSnapshot, after: NodeSnapshot, wall_s: float) -> list[dict[str, Any]]:
    """Per pipeline node (head first), what it did between the two snapshots."""
    rows = []
    previous: dict[str, Any] | None = None
    for node_id, now in after.items():
        then = before.get(node_id, {})
        batches = now.get("batches_total", 0) - then.get("batches_total", 0)
        busy = now.get("busy_seconds_total", 0.0) - then.get("busy_seconds_total", 0.0)
        # .get: a coordinator of an older version lacks these counters; they show as None
        hop = now.get("rtt_ms") if previous is None else previous.get("next_hop_rtt_ms")
        rows.append(
            {
                "node_id": node_id,
                "layers": [now["start"], now["end"]],
                "batches": batches,
                "messages": now.get("steps_total", 0) - then.get("steps_total", 0),
                "step_ms": busy / batches * 1000 if batches else None,
                "busy_share": busy / wall_s if wall_s > 0 else None,
                "hop_rtt_ms": hop or None,
                "coordinator_rtt_ms": now.get("rtt_ms") or None,
                **{key: now.get(key, 0) - then.get(key, 0) for key in DEPTH_COUNTERS},
            }
        )
        previous = now
    return rows


def depth_counts(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(steps decided, steps at depth 0, drafts chosen) over a scenario's `breakdown` rows
    (a run of an older version lacks them: zeros)."""
    steps, plain, drafts = (sum(row.get(key, 0) for row in rows) for key in DEPTH_COUNTERS)
    return steps, plain, drafts
