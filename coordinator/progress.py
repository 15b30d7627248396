"""Weights transfers as the operator sees them: a bar per node on the coordinator's terminal,
and the fraction that the dashboard and `cluster status` show."""

from __future__ import annotations

import sys
from typing import TextIO

from cluster.weights.source import Transfer
from proto import cluster_pb2 as pb

BAR_WIDTH = 30


def transfer_fraction(info: pb.NodeInfo) -> float | None:
    """The node's own count of its transfer (None when it has none under way)."""
    total = info.weights_fetch_total_bytes
    if not total or info.weights_fetched_bytes >= total:
        return None
    return info.weights_fetched_bytes / total


def bar_line(transfer: Transfer, now: float) -> str:
    filled = int(transfer.fraction * BAR_WIDTH)
    elapsed = max(now - transfer.started, 1e-6)
    rate = transfer.sent_bytes / elapsed / 2**20
    state = "error: " + transfer.error if transfer.error else ("done" if transfer.done else "")
    return (
        f"weights -> {transfer.node_id:<24} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
        f"{transfer.fraction:>4.0%} {transfer.sent_bytes / 2**20:8.1f}/"
        f"{transfer.total_bytes / 2**20:.1f} MiB {rate:7.1f} MiB/s {state}"
    )


class ProgressBars:
    """Redraws one line per node while transfers run (a TTY), or prints each node's line at
    every quarter and at the end (a log file)."""

    def __init__(self, out: TextIO | None = None):
        self.out = out or sys.stderr
        self._drawn = 0
        self._quarters: dict[tuple[str, float], int] = {}  # by transfer: (node, its start)

    def draw(self, transfers: list[Transfer], now: float) -> None:
        active = [t for t in transfers if t.total_bytes and not self._finished(t)]
        if self.out.isatty():
            self._redraw(active, now)
        else:
            self._log(active, now)

    def _finished(self, transfer: Transfer) -> bool:
        return self._quarters.get(_key(transfer)) == -1

    def _redraw(self, active: list[Transfer], now: float) -> None:
        if not active:
            return
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F")
        for transfer in active:
            self.out.write("\x1b[2K" + bar_line(transfer, now) + "\n")
            if transfer.done:
                self._quarters[_key(transfer)] = -1
        self._drawn = 0 if all(t.done for t in active) else len(active)
        self.out.flush()

    def _log(self, active: list[Transfer], now: float) -> None:
        for transfer in active:
            quarter = -1 if transfer.done else int(transfer.fraction * 4)
            if quarter != self._quarters.get(_key(transfer)):
                self._quarters[_key(transfer)] = quarter
                self.out.write(bar_line(transfer, now) + "\n")
        self.out.flush()


def _key(transfer: Transfer) -> tuple[str, float]:
    return transfer.node_id, transfer.started
