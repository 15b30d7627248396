"""The committed gRPC modules match proto/cluster.proto, and import as the `proto` package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_files_are_up_to_date():
    pytest.importorskip("grpc_tools")
    done = subprocess.run(
        [sys.executable, "-m", "proto.generate", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr


def test_generated_modules_import_from_the_package():
    from proto import cluster_pb2, cluster_pb2_grpc

    assert cluster_pb2.DESCRIPTOR.package == "cluster.v1"
    assert cluster_pb2_grpc.NodeStub is not None
    service = cluster_pb2.DESCRIPTOR.services_by_name["Node"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {
        "Info": (False, False),
        "LoadShard": (False, False),
        "Steps": (True, True),
        "Results": (False, True),
        "Release": (False, False),
        "Rollback": (False, False),
        "DropPrefixSnapshots": (False, False),
        "LinkPing": (False, False),
    }


def test_presence_where_zero_means_something():
    from proto import cluster_pb2 as pb

    def wire(msg):
        return type(msg).FromString(msg.SerializeToString())

    assert not wire(pb.LoadShardRequest(model_dir="/m")).HasField("cache_budget_bytes")
    assert wire(pb.LoadShardRequest(cache_budget_bytes=0)).HasField("cache_budget_bytes")
    assert not wire(pb.NodeInfo(node_id="n")).HasField("shard")
    assert wire(pb.NodeInfo(shard=pb.ShardSpec(start=0, end=0))).HasField("shard")
    assert wire(pb.SamplingParams(temperature=0.0)).HasField("temperature")
    assert wire(pb.RequestOptions(mtp_depth=0)).HasField("mtp_depth")
    assert wire(pb.StepEntry(sample=False)).HasField("sample")
    assert not wire(pb.StepBatch()).HasField("hidden")
