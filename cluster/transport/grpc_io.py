"""Which of gRPC's I/O paths every process of the cluster uses: the one that makes a hop cheapest.

gRPC 1.84 and 1.85 move messages between their sockets and the asyncio loop through the
EventEngine by default, which wakes more threads per message than the older I/O path: 14
voluntary context switches per round trip of the hop benchmark against 8. A bare grpc.aio echo
of a decode step's 20 KB took 94-121 us one way against 57-82 us with the EventEngine's client
and listener off (an H100 host, 16 cores and pinned to 2), and 124-162 against 62-68 us on the
2-core CI-like VM; the protobuf step stream 217-238 against 130-172 us
(`python -m benchmarks.hop`, BENCHMARKS.md, issue 10).

gRPC reads GRPC_EXPERIMENTS once, when it is first imported, so `cluster/__init__.py` sets it
before any module imports grpc. A value already in the environment wins: `GRPC_EXPERIMENTS=`
(empty) keeps gRPC's own defaults. A later gRPC without these experiments logs "Unknown
experiment" once and runs its defaults.
"""

from __future__ import annotations

import os

# The EventEngine's TCP client and listener off: gRPC's older I/O path for channels and servers.
LEGACY_IO_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def choose_io_path() -> None:
    """Set GRPC_EXPERIMENTS for the older I/O path unless the environment sets it already."""
    os.environ.setdefault("GRPC_EXPERIMENTS", LEGACY_IO_EXPERIMENTS)
