"""The time from a link's loss to the first step after it, on loopback.

A step stream (`cluster.transport.failover.StepStreamLink`) runs over a relay that stands
for the fast path (127.0.0.2) and can fall back to the direct address (127.0.0.1). A step
goes out every `--interval-ms` (a decode step's pace); at a random moment the relay goes
silent, as a pulled cable leaves a TCP stream: no reset, nothing delivered. The figure is
the time from that moment to the arrival of the first step not delivered before it; every
step must arrive exactly once. Detection dominates it (`failover.STALL_S`).

    python -m benchmarks.link_failover --trials 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time

from cluster.transport.failover import Route, StepStreamLink
from cluster.transport.step_link import StepListener
from proto import cluster_pb2 as pb

TOKEN = "link-failover-bench"
FAST, SLOW = "127.0.0.2", "127.0.0.1"


class Relay:
    """A TCP relay from FAST:port to SLOW:port that the test can cut: while cut, it passes
    nothing on either way and accepts nothing (an interface gone down, not a reset)."""

    def __init__(self, port: int):
        self.port = port
        self.cut = False
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, FAST, self.port)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(SLOW, self.port)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await source.read(65536):
                while self.cut:  # held, never delivered: the path is gone
                    await asyncio.sleep(3600)
                sink.write(data)
                await sink.drain()
        sink.transport.abort()

    async def close(self) -> None:
        for task in list(self._pipes):
            task.cancel()
        if self._server is not None:
            self._server.close()


async def one_trial(interval_s: float) -> float:
    arrived: dict[int, float] = {}
    listener = StepListener(TOKEN, lambda m: arrived.setdefault(m.sequence, time.perf_counter()))
    port = await listener.start(SLOW)
    relay = Relay(port)
    await relay.start()
    routes = (Route(FAST, 1, "fast"), Route(SLOW, 1, "slow"))
    link = await StepStreamLink.open("bench", routes, "", TOKEN, None, port)
    cut_at = 0.0
    try:
        cut_after = random.randint(20, 60)
        sequence = 0
        while True:
            sequence += 1
            await link.send(pb.StepBatch(sequence=sequence, epoch=1).SerializeToString())
            if sequence == cut_after:
                relay.cut, cut_at = True, time.perf_counter()
            if cut_at and any(t > cut_at for t in arrived.values()):
                break
            await asyncio.sleep(interval_s)
        lost_first = min(seq for seq, t in arrived.items() if t > cut_at)
        if sorted(arrived) != list(range(1, len(arrived) + 1)):
            raise AssertionError(f"steps lost or repeated: {sorted(arrived)}")
        return arrived[lost_first] - cut_at
    finally:
        await link.close()
        await relay.close()
        await listener.close()


async def main(trials: int, interval_s: float) -> None:
    figures = [await one_trial(interval_s) for _ in range(trials)]
    ms = sorted(1000 * f for f in figures)
    print(f"link loss to the first step after it, {trials} trials, a step every "
          f"{interval_s * 1000:.0f} ms: median {statistics.median(ms):.0f} ms, "
          f"min {ms[0]:.0f} ms, max {ms[-1]:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.link_failover", description=__doc__)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(main(args.trials, args.interval_ms / 1000))
