"""A cluster the bench starts for itself: `cluster up --local N` in a child process.

The child runs N node daemons and the coordinator, as a user's `cluster up` would, in its
own process group; the bench talks to it over HTTP only, exactly as with `--url`. On exit it
gets Ctrl-C's signal (it stops its own nodes), then SIGKILL if it does not go.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 180.0


class LocalClusterError(RuntimeError):
    """The local cluster did not come up."""


class LocalCluster:
    """`with LocalCluster(3, model_dir) as cluster:` ... `cluster.url` ..."""

    def __init__(self, count: int, model_dir: Path) -> None:
        if count < 1:
            raise LocalClusterError(f"--local needs at least one node, got {count}")
        self.count = count
        self.model_dir = model_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in __exit__
            prefix="cluster-bench-", suffix=".log", delete=False
        )
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LocalCluster:
        command = [sys.executable, "-m", "cluster", "up", "--local", str(self.count),
                   "--port", str(self.port), "--model", str(self.model_dir)]  # fmt: skip
        token = os.environ.get("CLUSTER_TOKEN") or os.urandom(16).hex()
        env = {**os.environ, "CLUSTER_TOKEN": token}
        self._proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise LocalClusterError(
                    f"`cluster up --local {self.count}` exited with {self._proc.returncode}:\n"
                    + _tail(Path(self._log.name))
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            if time.monotonic() > deadline:
                raise LocalClusterError(
                    f"the local cluster was not healthy after {START_TIMEOUT_S:.0f} s:\n"
                    + _tail(Path(self._log.name))
                )
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text()[-chars:]
    except OSError:
        return "(no log)"
