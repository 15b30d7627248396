"""`cluster up --local`'s nodes pick their own ports: none can be taken by another process
between a choice and the bind (two test workers starting clusters at once did that), and a
node that fails to start is named and the others stopped."""

from __future__ import annotations

import os
import socket

import click
import pytest

from cluster.commands import up


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_each_node_listens_on_the_port_it_reports() -> None:
    procs, ports = up._start_local_nodes(2, {**os.environ, "CLUSTER_TOKEN": "t"}, [])
    try:
        assert len(set(ports)) == 2 and all(p > 0 for p in ports)
        assert all(_listens(p) for p in ports)
        assert all(proc.poll() is None for proc in procs)
    finally:
        up._stop_nodes(procs)
    assert all(proc.poll() is not None for proc in procs)


def test_a_node_that_exits_first_is_named_and_the_others_stopped(tmp_path, monkeypatch) -> None:
    started = []
    popen = up.subprocess.Popen

    def record(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(up.subprocess, "Popen", record)
    missing = tmp_path / "missing.pem"  # every node refuses it: a usage error, exit status 2
    with pytest.raises(click.ClickException, match="node local-0 exited with 2"):
        up._start_local_nodes(2, {**os.environ, "CLUSTER_TOKEN": "t"}, [f"--tls-cert={missing}"])
    assert len(started) == 2 and all(proc.poll() is not None for proc in started)
