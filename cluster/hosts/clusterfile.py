"""The cluster file: which hosts run nodes, how to reach them, and what to serve (TOML).

    model = "/Users/me/models/Qwen3.5-122B-A10B-4bit"   # on this machine, or owner/name
    port = 8000                                         # the HTTP endpoint
    host = "0.0.0.0"                                    # beyond loopback: with an API key
    api_key_file = "~/.config/qwencluster/api-keys"     # one key a line
    # also: mtp_depth, prefix_cache, open_monitoring, tls_cert, tls_key, max_running,
    # max_queued, max_context, weights_port (as `cluster coordinator`'s flags, which win)

    [[node]]
    ssh = "mac-studio-1"     # anything `ssh` accepts: a ~/.ssh/config alias, user@host
    name = "studio"          # optional: default from ssh (10.0.0.2, mac-1, the alias)
    address = "10.10.0.1"    # optional: the data-plane address (or interface, e.g. "bridge0")
    port = 50151             # optional: the node's port
    memory_gb = 96           # optional: a cap on what the planner may use there
    cluster = "/Users/me/qwen/.venv/bin/cluster"   # optional: the command on that host

Nodes the file puts on one ssh host (other ports) each plan within an even share of its memory.

Every mistake is reported with the file, the key and what to write instead.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DEFAULT_NODE_PORT = 50151
SERVICES = ("auto", "launchd", "systemd", "process")
# The coordinator's serving options a cluster file may give, by key: what each must be.
_SERVING_KEYS: dict[str, type | tuple[type, ...]] = {
    "api_key_file": str, "mtp_depth": (int, str), "prefix_cache": bool,
    "open_monitoring": bool, "tls_cert": str, "tls_key": str, "max_running": int,
    "max_queued": int, "max_context": int, "weights_port": int,
}  # fmt: skip
_SERVING_PATHS = {"api_key_file", "tls_cert", "tls_key"}  # relative to the cluster file
_TOP_KEYS = {"model", "port", "host", "secret_file", "ssh_config", "node", *_SERVING_KEYS}
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
    # Of its host's memory: 1/k where the file puts k nodes on one ssh host (they share it).
    memory_share: float = 1.0
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
    # The coordinator's serving options the file gives (`_SERVING_KEYS`), paths made absolute;
    # `cluster up` lays its flags over them (coordinator.settings.ServingOptions).
    serving: dict[str, Any] = field(default_factory=dict)

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


def ssh_host(ssh: str) -> str:
    """The host part of an ssh target: `user@host`, `[v6]`, `ssh://user@host:port` -> host."""
    target = ssh.removeprefix("ssh://")
    target = target.rsplit("@", 1)[-1]
    if target.startswith("["):  # [fe80::1] or [fe80::1]:22
        return target[1 : target.find("]")] if "]" in target else target[1:]
    if ssh.startswith("ssh://") and target.count(":") == 1:  # ssh://host:2222
        return target.split(":", 1)[0]
    return target


def _readable(host: str, *, whole: bool) -> str:
    """A name from a host: an IP address whole (its ':' and '%' as '-'), a host name's first
    label (`mac-1.local` -> `mac-1`) unless `whole`, an ssh alias as it is."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        is_ip = True
    except ValueError:
        is_ip = False
    if not is_ip and not whole:
        host = host.split(".")[0]
    # Names become a launchd label, a systemd unit and a directory on the host: keep them to
    # letters, digits, '_', '.' and '-' (no ':' for macOS paths, no '/' or '%').
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", host)[:63].rstrip(".-")
    return name if name[:1].isalnum() else f"host{name}"[:63]


def default_name(ssh: str, port: int | None = None, *, whole: bool = False) -> str:
    """A node's name from its ssh target, when the file gives none: `user@10.0.0.2` ->
    `10.0.0.2`, `[fe80::1]` -> `fe80--1`, `me@mac-1.local` -> `mac-1` (its whole host name
    with `whole`), an alias -> the alias; `-PORT` after it where `port` is given."""
    name = _readable(ssh_host(ssh), whole=whole)
    if port is not None:
        name = f"{name[: 62 - len(str(port))]}-{port}"
    return name


def _serving(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The serving keys of the file, each checked for its type (and range) here, so that a
    mistake names the file and the key before any host is touched."""
    serving: dict[str, Any] = {}
    for key, kind in _SERVING_KEYS.items():
        if key not in data:
            continue
        value = data[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise _fail(path, f"{key} must be true or false, got {value!r}")
        else:
            value = _typed(path, "", key, value, kind)
        if key in _SERVING_PATHS:
            value = Path(value).expanduser()
            # Read when the coordinator's settings are built (before any host is touched).
            value = value if value.is_absolute() else path.parent / value
        elif (
            key == "mtp_depth"
            and value != "auto"
            and not (isinstance(value, int) and 0 <= value <= 8)
        ):
            raise _fail(path, f'mtp_depth must be 0-8 or "auto", got {value!r}')
        elif key in ("max_running", "max_queued", "weights_port") and not (
            (1 if key == "max_running" else 0) <= value <= 65535
        ):
            raise _fail(path, f"{key} out of range, got {value}")
        elif key == "max_context" and value < 1:
            # Its upper bound is the model's own context, checked with the model's config.
            raise _fail(path, f"max_context must be at least 1 token, got {value}")
        serving[key] = value
    return serving


def _model(path: Path, text: str, resolve: bool) -> Path:
    """The model directory: a path (relative to the file), or a Hugging Face repo id resolved
    through the hub's cache on this machine (`cluster.hub`) when `resolve`, else kept as its
    text (for commands that never read it, such as `cluster down`)."""
    from cluster.hub import looks_like_repo_id

    model = Path(text).expanduser()
    if not model.is_absolute():
        model = path.parent / model
    if not model.exists() and looks_like_repo_id(text):
        if not resolve:
            return Path(text)
        from cluster.config import ModelDirError
        from cluster.hub import resolve_model

        try:
            return resolve_model(text)
        except ModelDirError as error:
            raise _fail(path, f"model {text!r}: {error}") from None
    if not (model / "config.json").is_file():
        raise _fail(path, f"model {str(model)!r} is not a model directory (no config.json)")
    return model


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
    port = _port(path, where, table.get("port", DEFAULT_NODE_PORT))
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
        port=port,
        memory_gb=float(memory) if memory is not None else None,
        cluster=command,
        service=service,
        state_dir=_typed(path, where, "state_dir", state_dir, str) if state_dir else None,
    )


def _unique_names(path: Path, nodes: list[HostNode], tables: list[Any]) -> list[HostNode]:
    """Default names made unique, then every name checked.

    Default names that two hosts share (`mac-1.lan`, `mac-1.office`) keep the whole host
    name; nodes of one host on several ports get `-PORT` after it, all but the one on the
    lowest port. So adding a node to the file renames (and so reinstalls) none of those
    already there, unless its host's first label is alike. A name still shared, or given
    twice, is reported.
    """
    given = [isinstance(table, dict) and "name" in table for table in tables]

    def clashing(nodes: list[HostNode]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            groups.setdefault(node.name, []).append(i)
        return {name: group for name, group in groups.items() if len(group) > 1}

    nodes = list(nodes)
    for group in clashing(nodes).values():
        if len({ssh_host(nodes[i].ssh) for i in group}) > 1:  # other hosts, alike names
            for i in group:
                if not given[i]:
                    nodes[i] = replace(nodes[i], name=default_name(nodes[i].ssh, whole=True))
    for group in clashing(nodes).values():
        by_port = sorted((i for i in group if not given[i]), key=lambda i: nodes[i].port)
        for i in by_port[1:]:
            if nodes[i].port != nodes[by_port[0]].port:
                nodes[i] = replace(nodes[i], name=f"{nodes[i].name[:56]}-{nodes[i].port}")
    seen: dict[str, HostNode] = {}
    for node in nodes:
        other = seen.setdefault(node.name, node)
        if other is node:
            continue
        if ssh_host(node.ssh) == ssh_host(other.ssh) and node.port == other.port:
            raise _fail(
                path,
                f"[[node]] {node.ssh!r} and {other.ssh!r} are one host and port "
                f"({node.port}): give one of them another port = N",
            )
        raise _fail(
            path,
            f"[[node]] {node.ssh!r} and {other.ssh!r} share the name {node.name!r}: "
            'give one of them name = "..."',
        )
    return nodes


def _shares(nodes: list[HostNode]) -> list[HostNode]:
    """Nodes on one ssh host share its memory: each plans within an even share of it."""
    per_host = Counter(ssh_host(node.ssh) for node in nodes)
    return [replace(node, memory_share=1 / per_host[ssh_host(node.ssh)]) for node in nodes]


def load_cluster_file(path: str | Path, *, resolve_model: bool = True) -> ClusterFile:
    """The cluster file at `path`, checked; a model given as a repo id is resolved (fetched
    into the Hugging Face cache if missing) unless not to `resolve_model`."""
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
        raise _fail(
            path, 'needs model = "/path/to/model" (a directory on this machine, or owner/name)'
        )
    model = _model(path, _typed(path, "", "model", data["model"], str), resolve_model)
    tables = data.get("node", [])
    if not isinstance(tables, list) or not tables:
        raise _fail(path, "needs at least one [[node]] table with ssh = HOST")
    nodes = _shares(
        _unique_names(path, [_node(path, i, table) for i, table in enumerate(tables)], tables)
    )
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
        serving=_serving(path, data),
    )
