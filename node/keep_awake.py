"""Keeping a node's Mac awake while it holds a shard.

A sleeping Mac is a lost pipeline stage, and macOS sleeps an idle desktop (or a laptop on
battery) within minutes. While a shard is loaded the node holds a power assertion against idle
sleep (`-i`) and system sleep (`-s`, which macOS honours on AC power only), through
`caffeinate -i -s -w PID` run beside it, PID being the node's own process:

- `-w PID` ties the assertion to the node's life: caffeinate exits, and macOS drops the
  assertion, as soon as the node's process is gone, however it ended (a crash or SIGKILL
  included), so an assertion can never outlive its node.
- It is a tool every macOS has; `pmset -g assertions` shows it by name; and nothing of
  CoreFoundation or IOKit has to be bridged through ctypes into a process that runs MLX (an
  `IOPMAssertionCreateWithName` would do the same, but with CFString handling that fails
  silently where a signature is wrong, and that cannot be exercised off a Mac).

Unloading the shard or stopping the node ends caffeinate, and with it the assertion. On Linux,
and wherever `caffeinate` is missing, nothing is held: `holding` is false and `reason` says
why, which the node reports in its info (`NodeInfo.keeps_awake`, `keep_awake_note`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

CAFFEINATE = "caffeinate"
# Where macOS has it: a launchd agent's PATH is short, and the lookup must not depend on it.
CAFFEINATE_PATH = "/usr/bin/caffeinate"
STOP_WAIT_S = 2.0


def caffeinate_argv(binary: str, pid: int) -> list[str]:
    """Idle and system sleep prevented until process `pid` exits."""
    return [binary, "-i", "-s", "-w", str(pid)]


class KeepAwake:
    """Holds the Mac awake between `hold()` and `release()` (both idempotent)."""

    def __init__(
        self,
        *,
        platform: str | None = None,
        which: Callable[[str], str | None] = shutil.which,
        popen: Callable[..., subprocess.Popen] = subprocess.Popen,
        pid: int | None = None,
    ) -> None:
        self.platform = platform or sys.platform
        self._which = which
        self._popen = popen
        self._pid = pid or os.getpid()
        self._process: subprocess.Popen | None = None
        self._reason = "no shard loaded" if self.mac else self._not_mac()

    @property
    def mac(self) -> bool:
        return self.platform == "darwin"

    def _not_mac(self) -> str:
        return f"not macOS ({self.platform}): nothing to keep awake"

    @property
    def holding(self) -> bool:
        """Whether the assertion is held now (its caffeinate is running)."""
        return self._process is not None and self._process.poll() is None

    @property
    def reason(self) -> str:
        """What holds the Mac awake, or why nothing does."""
        if self._process is not None and not self.holding:
            return f"caffeinate exited with {self._process.returncode}; nothing keeps it awake"
        return self._reason

    def hold(self) -> bool:
        """Take the assertion (a shard is loaded); whether it is held."""
        if self.holding:
            return True
        self._process = None
        if not self.mac:
            self._reason = self._not_mac()
            return False
        binary = self._which(CAFFEINATE) or self._which(CAFFEINATE_PATH)
        if binary is None:
            self._reason = "caffeinate not found: the Mac may sleep"
            return False
        argv = caffeinate_argv(binary, self._pid)
        try:
            self._process = self._popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as error:
            self._reason = f"caffeinate did not start: {error}"
            log.warning("cannot keep this Mac awake: %s", error)
            return False
        self._reason = f"held by {' '.join(argv)}"
        log.info("keeping this Mac awake while the shard is loaded (%s)", " ".join(argv))
        return True

    def release(self, why: str = "no shard loaded") -> None:
        """Drop the assertion (the shard is unloaded, or the node stops)."""
        process, self._process = self._process, None
        if self.mac:
            self._reason = why
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
        log.info("this Mac may sleep again (%s)", why)
