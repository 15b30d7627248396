"""The cluster file: which hosts run nodes, how to reach them, and what to serve (TOML).

    model = "/Users/me/models/Qwen3.5-122B-A10B-4bit"   # on this machine
    port = 8000                                         # the HTTP endpoint

    [[node]]
    ssh = "mac-studio-1"     # anything `ssh` accepts: a ~/.ssh/config alias, user@host
    address = "10.10.0.1"    # optional: the data-plane address (or interface, e.g. "bridge0")
    port = 50151             # optional: the node's port
    memory_gb = 96           # optional: a cap on what the planner may use there
    cluster = "/Users/me/qwen/.venv/bin/cluster"   # optional: the command on that host

Every mistake is reported with the file, the key and what to write instead.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_NODE_PORT = 50151
SERVICES = ("auto", "launchd", "systemd", "process")
_TOP_KEYS = {"model", "port", "host", "secret_file", "ssh_config", "node"}
_NODE_KEYS = {"ssh", "name", "address", "port", "memory_gb", "cluster", "service", "state_dir"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class ClusterFileError(ValueError):
    """A cluster file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class HostNode:
    """One `[[node]]` table."""

    ssh: str
    name: str  # unique in the file: names the service and the state on the host
    address: str | None = None  # data plane; None: measured (the ssh address to start with)
    port: int = DEFAULT_NODE_PORT
    memory_gb: float | None = None
    cluster: str = "cluster"  # the command on the host (may be "python -m cluster")
    service: str = "auto"
    state_dir: str | None = None  # on the host; None: the platform's default


@dataclass(frozen=True, slots=True)
class ClusterFile:
    path: Path
    model: Path
    port: int = 8000
    host: str = "127.0.0.1"  # where the HTTP endpoint listens
    secret_file: Path | None = None  # on this machine; None: next to the cluster file
    ssh_config: Path | None = None  # given to ssh as -F; None: the user's own
    nodes: list[HostNode] = field(default_factory=list)

    @property
    def secret_path(self) -> Path:
        return self.secret_file or self.path.with_name(f".{self.path.stem}.secret")


def _fail(path: Path, message: str) -> ClusterFileError:
    return ClusterFileError(f"{path}: {message}")


def _suggest(key: str, allowed: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, sorted(allowed), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; allowed: {', '.join(sorted(allowed))}"


def _typed(path: Path, where: str, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _fail(path, f"{where}{key} must be a {names}, got {value!r}")
    return value


def _port(path: Path, where: str, value: Any) -> int:
    port = _typed(path, where, "port", value, int)
    if not 1 <= port <= 65535:
        raise _fail(path, f"{where}port must be 1-65535, got {port}")
    return port


def default_name(ssh: str) -> str:
    """A service name from the ssh target: user@mac-1.local -> mac-1."""
    host = ssh.rsplit("@", 1)[-1].split(".")[0] or "node"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", host)[:63]


def _node(path: Path, index: int, table: Any) -> HostNode:
    where = f"[[node]] #{index + 1}: "
    if not isinstance(table, dict):
        raise _fail(path, f"{where}must be a table ([[node]])")
    for key in table:
        if key not in _NODE_KEYS:
            raise _fail(path, where + _suggest(key, _NODE_KEYS))
    if "ssh" not in table:
        raise _fail(path, f'{where}needs ssh = "HOST" (a host or ~/.ssh/config alias)')
    ssh = _typed(path, where, "ssh", table["ssh"], str).strip()
    if not ssh or ssh.startswith("-"):
        raise _fail(path, f"{where}ssh must name a host, got {ssh!r}")
    where = f"[[node]] {ssh!r}: "
    name = _typed(path, where, "name", table.get("name", default_name(ssh)), str)
    if not _NAME.match(name):
        raise _fail(path, f"{where}name {name!r}: use letters, digits, '.', '_' or '-'")
    memory = table.get("memory_gb")
    if memory is not None and _typed(path, where, "memory_gb", memory, (int, float)) <= 0:
        raise _fail(path, f"{where}memory_gb must be positive, got {memory}")
    service = _typed(path, where, "service", table.get("service", "auto"), str)
    if service not in SERVICES:
        raise _fail(path, f"{where}service must be one of {', '.join(SERVICES)}, got {service!r}")
    address = table.get("address")
    command = _typed(path, where, "cluster", table.get("cluster", "cluster"), str).strip()
    if not command:
        raise _fail(path, f"{where}cluster must be the command's path, got an empty string")
    state_dir = table.get("state_dir")
    return HostNode(
        ssh=ssh,
        name=name,
        address=_typed(path, where, "address", address, str) if address is not None else None,
        port=_port(path, where, table.get("port", DEFAULT_NODE_PORT)),
        memory_gb=float(memory) if memory is not None else None,
        cluster=command,
        service=service,
        state_dir=_typed(path, where, "state_dir", state_dir, str) if state_dir else None,
    )


def load_cluster_file(path: str | Path) -> ClusterFile:
    path = Path(path).expanduser()
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ClusterFileError(f"{path}: no such cluster file") from None
    except OSError as error:
        raise ClusterFileError(f"{path}: cannot read it: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise _fail(path, f"not valid TOML: {error}") from None
    for key in data:
        if key not in _TOP_KEYS:
            raise _fail(path, _suggest(key, _TOP_KEYS))
    if "model" not in data:
        raise _fail(path, 'needs model = "/path/to/model" (a directory on this machine)')
    model = Path(_typed(path, "", "model", data["model"], str)).expanduser()
    if not model.is_absolute():
        model = path.parent / model
    if not (model / "config.json").is_file():
        raise _fail(path, f"model {str(model)!r} is not a model directory (no config.json)")
    tables = data.get("node", [])
    if not isinstance(tables, list) or not tables:
        raise _fail(path, "needs at least one [[node]] table with ssh = HOST")
    nodes = [_node(path, i, table) for i, table in enumerate(tables)]
    seen: dict[str, str] = {}
    for node in nodes:
        if node.name in seen:
            raise _fail(
                path,
                f"[[node]] {node.ssh!r} and {seen[node.name]!r} share the name {node.name!r}: "
                'give one of them name = "..."',
            )
        seen[node.name] = node.ssh
    secret_file = data.get("secret_file")
    ssh_config = data.get("ssh_config")
    return ClusterFile(
        path=path,
        model=model,
        port=_port(path, "", data.get("port", 8000)),
        host=_typed(path, "", "host", data.get("host", "127.0.0.1"), str),
        secret_file=Path(_typed(path, "", "secret_file", secret_file, str)).expanduser()
        if secret_file
        else None,
        ssh_config=Path(_typed(path, "", "ssh_config", ssh_config, str)).expanduser()
        if ssh_config
        else None,
        nodes=nodes,
    )
