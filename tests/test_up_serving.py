"""`cluster up` serves as `cluster coordinator` does: its serving options as flags, as keys of
the cluster file (the flags win) and from CLUSTER_API_KEY; an endpoint beyond loopback without
an API key is refused before any node starts, unless `--no-api-key` says it is meant."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cluster.commands import up as up_module
from cluster.commands.coordinator import build_settings, coordinator_command
from cluster.commands.up import hosts_serving, up_command
from cluster.config import bundled_model_path
from cluster.hosts.clusterfile import load_cluster_file
from coordinator.settings import CoordinatorSettings, OpenEndpointError, ServingOptions
from tests.daemons import NO_WARMUP, START_DEADLINE_S, stop_process_group, wait_until

_ENDPOINT = re.compile(r"OpenAI endpoint: (\S+)/v1")


# --- the settings, without starting anything ---------------------------------------------------


def _cluster_file(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "keys").write_text("# the file's key\nfile-key\n")
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'model = "{bundled_model_path()}"\nport = 8123\n{extra}\n[[node]]\nssh = "root@10.0.0.1"\n'
    )
    return path


def test_cluster_file_keys_reach_the_coordinator(tmp_path: Path) -> None:
    path = _cluster_file(
        tmp_path,
        'host = "0.0.0.0"\napi_key_file = "keys"\nmtp_depth = 3\nprefix_cache = false\n'
        "max_running = 4\nopen_monitoring = true\nmax_context = 4096\n",
    )
    cluster = load_cluster_file(path)
    settings = build_settings(hosts_serving(cluster, ServingOptions()), cluster.model, "secret")
    assert settings.host == "0.0.0.0" and settings.port == 8123
    assert settings.mtp_depth == 3 and settings.max_running == 4
    assert settings.max_context == 4096
    assert settings.prefix_cache is False
    assert settings.api_keys is not None and settings.api_keys.keys == (b"file-key",)
    assert settings.api_keys.open_monitoring and not settings.allow_open


def test_flags_win_over_the_cluster_file(tmp_path: Path) -> None:
    path = _cluster_file(
        tmp_path, 'host = "0.0.0.0"\napi_key_file = "keys"\nmtp_depth = 3\nmax_context = 4096\n'
    )
    cluster = load_cluster_file(path)
    flags = ServingOptions(
        mtp_depth="auto", api_key="flag-key", port=9000, max_queued=5, max_context=2048
    )
    settings = build_settings(hosts_serving(cluster, flags), cluster.model, "secret")
    assert settings.mtp_depth == "auto" and settings.port == 9000 and settings.max_queued == 5
    assert settings.max_context == 2048
    # The key is one choice: the flag's replaces the file's, it does not add to it.
    assert settings.api_keys is not None and settings.api_keys.keys == (b"flag-key",)
    assert settings.host == "0.0.0.0"  # not given as a flag: the file's
    # An explicit --no-api-key replaces the file's keys too.
    opened = build_settings(
        hosts_serving(cluster, ServingOptions(no_api_key=True)), cluster.model, "secret"
    )
    assert opened.api_keys is None and opened.allow_open


def test_a_bad_serving_key_in_the_cluster_file_names_it(tmp_path: Path) -> None:
    from cluster.hosts.clusterfile import ClusterFileError

    for extra, named in [
        ("mtp_depth = 9", "mtp_depth"),
        ('prefix_cache = "no"', "prefix_cache"),
        ("max_runing = 3", "did you mean 'max_running'"),
        ("max_context = 0", "max_context"),
    ]:
        with pytest.raises(ClusterFileError, match=named):
            load_cluster_file(_cluster_file(tmp_path, extra))
    # A key file that is not there stops `up` before any host is touched.
    cluster = load_cluster_file(_cluster_file(tmp_path, 'api_key_file = "absent"'))
    with pytest.raises(click.BadParameter, match="absent"):
        build_settings(hosts_serving(cluster, ServingOptions()), cluster.model, "secret")


def test_an_open_endpoint_is_refused_before_any_node_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_node(*args: object, **kwargs: object) -> None:
        raise AssertionError("a node was started")

    monkeypatch.setattr(up_module.subprocess, "Popen", no_node)
    monkeypatch.delenv("CLUSTER_API_KEY", raising=False)
    for command, argv in [
        (up_command, ["--local", "2", "--host", "0.0.0.0"]),
        (coordinator_command, ["--token", "t", "--host", "0.0.0.0"]),
    ]:
        result = CliRunner().invoke(command, argv)
        assert result.exit_code == 2, result.output
        assert "refusing to serve on 0.0.0.0 without an API key" in result.output
        assert "--api-key" in result.output and "--no-api-key" in result.output


def test_run_coordinator_refuses_an_open_endpoint_for_library_callers() -> None:
    from coordinator.service import run_coordinator

    settings = CoordinatorSettings(bundled_model_path(), "t", host="0.0.0.0", browse=False)
    with pytest.raises(OpenEndpointError, match="--api-key"):
        asyncio.run(run_coordinator(settings))


# --- cluster up, running -----------------------------------------------------------------------


@contextmanager
def _up(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`cluster up --local 1 ARGV` (in `env`, default this process's) until the block ends;
    yields its endpoint's URL."""
    log = tmp_path / "up.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster", "up", "--local", "1", "--port", "0", NO_WARMUP, *argv],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=os.environ if env is None else env,
        start_new_session=True,
    )

    def endpoint() -> str | None:
        if process.poll() is not None:
            raise AssertionError(f"cluster up exited: {log.read_text()}")
        found = _ENDPOINT.search(log.read_text())
        return found.group(1).replace("0.0.0.0", "127.0.0.1") if found else None

    try:
        yield wait_until(endpoint, "cluster up's endpoint", START_DEADLINE_S)
    finally:
        stop_process_group(process, timeout_s=30)


def _status(url: str, key: str | None = None) -> int:
    body = json.dumps({"prompt": "def f(", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, method="POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_up_with_an_api_key_asks_for_it(tmp_path: Path) -> None:
    with _up(tmp_path, "--api-key", "K") as url:
        assert _status(url) == 401
        assert _status(url, "wrong") == 401
        assert _status(url, "K") == 200


def test_cluster_api_key_works_for_up_beyond_loopback(tmp_path: Path) -> None:
    env = {**os.environ, "CLUSTER_API_KEY": "env-key"}
    with _up(tmp_path, "--host", "0.0.0.0", env=env) as url:
        assert _status(url) == 401
        assert _status(url, "env-key") == 200


def test_no_api_key_serves_beyond_loopback_on_purpose(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_API_KEY"}
    with _up(tmp_path, "--host", "0.0.0.0", "--no-api-key", env=env) as url:
        assert _status(url) == 200


def test_up_hosts_refuses_an_open_endpoint_before_touching_a_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cluster.hosts.bringup as bringup

    def no_host(*args: object, **kwargs: object) -> None:
        raise AssertionError("a host was touched")

    monkeypatch.setattr(bringup, "bring_up", no_host)
    monkeypatch.delenv("CLUSTER_API_KEY", raising=False)
    path = _cluster_file(tmp_path, 'host = "0.0.0.0"')
    result = CliRunner().invoke(up_command, ["--hosts", str(path)])
    assert result.exit_code == 2 and "--api-key" in result.output, result.output
