"""`cluster ...` processes for end-to-end tests, and polling with a deadline."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A cluster's start includes its warm-up (about 35 s of the bundled model on 2 idle cores),
# and the suite runs two tests at once beside the processes they start. The warm-up is the
# subject of tests/test_warmup.py, and `cluster up` and `cluster bench` run it as users do
# (tests/test_up.py, tests/test_bench.py); every other cluster a test starts skips it with
# NO_WARMUP, its output being the same either way, so that the suite stays within its time.
START_DEADLINE_S = 120.0
NO_WARMUP = "--no-warmup"
LISTENING = re.compile(r"listening on \S+:(\d+)")
ENDPOINT = re.compile(r"OpenAI endpoint: (\S+)/v1")


def wait_until(condition: Callable[[], Any], what: str, deadline_s: float = 20.0) -> Any:
    """Poll `condition` until it returns something truthy; fail after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.05)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    """A `cluster ...` process in its own process group, its output in a file."""

    process: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, log: Path, token: str, *args: str) -> Daemon:
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster", *args],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "CLUSTER_TOKEN": token},
            start_new_session=True,
        )
        return cls(process, log)

    def wait_for(self, pattern: re.Pattern[str]) -> str:
        """The first group of `pattern` once the process has printed it."""

        def found() -> str | None:
            text = self.log.read_text()
            if self.process.poll() is not None:
                raise AssertionError(f"{self.process.args} exited:\n{text}")
            match = pattern.search(text)
            return match.group(1) if match else None

        return wait_until(found, f"{pattern.pattern!r} in {self.log.name}", START_DEADLINE_S)

    def stop(self) -> None:
        """Ctrl-C (a node says goodbye over mDNS on its way out), then SIGKILL if need be."""
        stop_process_group(self.process)


def stop_process_group(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Ctrl-C to the process group of `process` (started with `start_new_session`), then
    SIGKILL when it has not exited within `timeout_s`."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
