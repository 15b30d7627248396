"""A cluster the bench starts for itself: `cluster up` in a child process.

`--local N`: the child runs N node daemons and the coordinator on this machine. `--hosts
FILE`: it brings the node services up on the cluster file's hosts over ssh and runs the
coordinator here (the services stay up afterwards, as with `cluster up --hosts`; `cluster down
--hosts FILE` removes them). Either way the bench talks to the child over HTTP only, exactly as
with `--url`. On exit the child gets Ctrl-C's signal (a local one stops its own nodes), then
SIGKILL if it does not go.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 180.0
_ENDPOINT = re.compile(r"OpenAI endpoint: http://\S+:(\d+)/v1")


class ClusterUpError(RuntimeError):
    """The cluster did not come up."""


class ClusterUp:
    """`with ClusterUp.local(3, model_dir) as cluster:` ... `cluster.url` ..."""

    def __init__(self, up_args: list[str], host: str = "127.0.0.1") -> None:
        # Any free port, as the coordinator binds it: one chosen here could be taken by
        # another process before the coordinator binds it, and then answer in its place.
        self.up_args = [*up_args, "--port", "0"]
        self.host = host
        self.url = ""  # once ready: from the endpoint line `cluster up` prints
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in __exit__
            prefix="cluster-bench-", suffix=".log", delete=False
        )
        self._proc: subprocess.Popen | None = None

    @classmethod
    def local(cls, count: int, model_dir: Path) -> ClusterUp:
        if count < 1:
            raise ClusterUpError(f"--local needs at least one node, got {count}")
        return cls(["--local", str(count), "--model", str(model_dir)])

    @classmethod
    def hosts(cls, cluster_file: Path, host: str) -> ClusterUp:
        """The coordinator listens on the cluster file's `host`."""
        return cls(["--hosts", str(cluster_file)], host)

    def __enter__(self) -> ClusterUp:
        command = [sys.executable, "-m", "cluster", "up", *self.up_args]
        token = os.environ.get("CLUSTER_TOKEN") or os.urandom(16).hex()
        env = {**os.environ, "CLUSTER_TOKEN": token}
        self._proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_serving()
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

    def _wait_serving(self) -> None:
        """Wait for the endpoint line, which `cluster up` prints once the cluster serves."""
        deadline = time.monotonic() + START_TIMEOUT_S
        log = Path(self._log.name)
        while True:
            assert self._proc is not None
            match = _ENDPOINT.search(log.read_text(errors="replace"))
            if match:
                self.url = f"http://{_reachable(self.host)}:{match.group(1)}"
                return
            if self._proc.poll() is not None:
                raise ClusterUpError(
                    f"`cluster up {' '.join(self.up_args)}` exited with "
                    f"{self._proc.returncode}:\n" + _tail(log)
                )
            if time.monotonic() > deadline:
                raise ClusterUpError(
                    f"the cluster was not serving after {START_TIMEOUT_S:.0f} s:\n" + _tail(log)
                )
            time.sleep(0.2)


def _reachable(host: str) -> str:
    """An address to reach a server listening on `host` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text()[-chars:]
    except OSError:
        return "(no log)"
