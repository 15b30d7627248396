"""`cluster.transport.grpc_io`: every cluster process picks gRPC's older I/O path unless told
otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

from cluster.transport.grpc_io import LEGACY_IO_EXPERIMENTS

# gRPC reads GRPC_EXPERIMENTS at its first import: set by the time a cluster module imports it.
PROBE = "import os, cluster.transport.wire; print(os.environ.get('GRPC_EXPERIMENTS'))"


def _probe(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.rstrip("\n")


def test_cluster_sets_the_legacy_io_path_before_grpc_loads():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _probe(env) == LEGACY_IO_EXPERIMENTS


def test_the_environment_wins_even_empty():
    for value in ("", "-event_engine_client"):
        assert _probe({**os.environ, "GRPC_EXPERIMENTS": value}) == value
