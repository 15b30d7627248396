"""The cluster secret in a file only its owner can read.

Generated once (the first `cluster up --hosts`), kept in a 0600 file on this machine and on
every host, and handed to node daemons as `--token-file PATH`: the secret itself is never on
a command line, where `ps` would show it to every local user. Rotate it by deleting the file
here and running `cluster up --hosts FILE` again: each host gets the new secret and its node
restarts with it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRET_BYTES = 24


class SecretFileError(OSError):
    """A secret file that is missing, empty, or readable by others."""


def write_secret(path: Path, secret: str) -> None:
    """Write `secret` to `path` (mode 0600 from the start: never briefly readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secret + "\n").encode())
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
    os.replace(temporary, path)


def read_secret(path: Path) -> str:
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except FileNotFoundError:
        raise SecretFileError(f"no cluster secret at {path}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretFileError(
            f"the cluster secret {path} is readable by others (mode {stat.S_IMODE(mode):o}): "
            f"run chmod 600 {path}"
        )
    if not text:
        raise SecretFileError(f"the cluster secret {path} is empty")
    return text


def ensure_secret(path: Path) -> str:
    """The secret in `path`, generated there first if there is none."""
    if not path.exists():
        write_secret(path, secrets.token_hex(SECRET_BYTES))
    return read_secret(path)
