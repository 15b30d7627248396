"""Commands on other hosts through the user's own `ssh`.

`ssh` runs as the user configured it (~/.ssh/config aliases, keys, agents), in BatchMode so
that a host which would ask for a password fails at once instead of hanging, with a short
connect timeout. Hosts are reached in parallel, one thread each.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

CONNECT_TIMEOUT_S = 5
SSH_FAILED = 255  # ssh's own exit status: it could not connect or log in

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True, slots=True)
class SSHResult:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True, slots=True)
class SSH:
    """How to reach hosts: the ssh binary and an optional config file (`-F`)."""

    config: Path | None = None
    binary: str = "ssh"

    def argv(self, target: str, remote: Sequence[str]) -> list[str]:
        options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
        if self.config is not None:
            options += ["-F", str(self.config)]
        target, port = destination(target)
        if port is not None:
            options += ["-p", port]
        # One string: the remote shell splits it, so every word is quoted once here.
        return [self.binary, *options, "--", target, " ".join(remote)]

    def run(
        self, target: str, remote: Sequence[str], *, stdin: str = "", timeout: float = 60.0
    ) -> SSHResult:
        """Run `remote` (already-quoted words) on `target`; `stdin` is how secrets travel."""
        try:
            done = subprocess.run(
                self.argv(target, remote),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return SSHResult(SSH_FAILED, "", f"no answer within {timeout:.0f} s")
        return SSHResult(done.returncode, done.stdout, done.stderr)


def destination(target: str) -> tuple[str, str | None]:
    """A cluster file's ssh target as `ssh` takes it, and a port where the target has one.

    IPv6 addresses are written bracketed (`root@[fe80::1]`, `[fe80::1]:2222`), which `ssh`
    does not resolve: the brackets go and the port becomes `-p`. Anything else is passed on
    as written (aliases, `user@host`, a bare IPv6 address, `ssh://` URIs)."""
    user, at, host = target.rpartition("@")
    if not host.startswith("[") or "]" not in host:
        return target, None
    address, _, rest = host[1:].partition("]")
    port = rest[1:] if rest.startswith(":") and rest[1:].isdigit() else None
    return f"{user}{at}{address}", port


def remote_words(command: str, *args: str) -> list[str]:
    """`command` as the cluster file gives it (it may be several words), then quoted args."""
    return [*(shlex.quote(w) for w in shlex.split(command)), *(shlex.quote(a) for a in args)]


def in_parallel(work: Callable[[T], U], items: Sequence[T]) -> list[U | BaseException]:
    """`work(item)` for every item at once; each result or the exception it raised."""

    def guarded(item: T) -> U | BaseException:
        try:
            return work(item)
        except Exception as error:
            return error

    with ThreadPoolExecutor(max_workers=max(len(items), 1)) as pool:
        return list(pool.map(guarded, items))
