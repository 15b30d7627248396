"""Which of gRPC's I/O paths every process of the cluster uses: the one that makes a hop cheapest.

`choose_io_path` turns off the EventEngine's TCP client and listener, so channels and servers use
gRPC's older I/O path. The EventEngine, gRPC's default in the versions this project runs (1.84,
1.85), wakes more threads per message than the older path, and a decode step crosses every hop
once per token, so through it a hop costs more; `python -m benchmarks.hop` compares the two.

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
