"""One rank of mlx-lm's ring pipeline on a host of a cluster file, run there over ssh by
`cluster bench --hosts` (`cluster.bench.ring_hosts`): `cluster hosts ring-probe|ring-rank|
ring-stop`.

ring-probe  what the rank will need: this project's version, mlx and mlx-lm importable by the
            interpreter of this host's `cluster`, the model at the cluster file's path, the
            host's memory, its addresses (the cluster file's, an interface resolved here; the
            one ssh came in on; every IPv4 network) and a port free on all of them
ring-rank   runs `python -m cluster.bench.ring_baseline --worker` with the environment
            `mlx.launch` gives a rank (MLX_RANK, MLX_HOSTFILE: a file holding every rank's
            ip:port), waits for it and prints one JSON object: rank 0's figures read from the
            file it wrote on this host (no shared filesystem), or the rank's log on failure.
            Its stdin is its lifeline: the settings come as the first line, and when stdin
            ends (the bench closes it, or the ssh connection is gone) the rank is killed;
            so is it past the run's deadline
ring-stop   kills a run's rank here (its process group) and deletes its files: the fallback
            when closing a rank's stdin does not reach it

Everything of a run lives in one directory per run and rank under the temp directory, named
by the run id, and goes when the rank ends. Each command prints one JSON object; nothing here
imports MLX but the probe's check.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from cluster import __version__

RUN_ID = re.compile(r"^[0-9a-f]{8,32}$")
STOP_WAIT_S = 5.0
LOG_TAIL_CHARS = 1500
POLL_S = 0.1


def _answer(**fields: object) -> None:
    click.echo(json.dumps(fields))


def run_dir(run_id: str, rank: int) -> Path:
    if not RUN_ID.match(run_id):
        raise click.ClickException(f"not a ring run id: {run_id!r}")
    return Path(tempfile.gettempdir()) / f"qwencluster-ring-{run_id}-{rank}"


def _mlx_problem() -> str:
    """Why this interpreter cannot run a ring rank, or ''."""
    try:
        import mlx.core as mx
        from mlx_lm import stream_generate  # noqa: F401  (runs mlx-lm's package body)
        from mlx_lm.utils import sharded_load  # noqa: F401  (what a rank loads with)
    except ImportError as error:
        return f"{sys.executable} cannot import mlx and mlx-lm ({error})"
    if not mx.distributed.is_available():
        return f"the mlx of {sys.executable} has no distributed backend"
    return ""


def _free_port(address: str, port: int = 0) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((address, port))
        return s.getsockname()[1]


def _networks() -> list[dict[str, object]]:
    """This host's IPv4 addresses (loopback left out) with their prefix lengths."""
    import ifaddr

    return [
        {"address": ip.ip, "prefix": ip.network_prefix}
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if ip.is_IPv4 and not ip.ip.startswith("127.")
    ]


@click.command("ring-probe")
@click.option("--model", "model_dir", required=True, help="The cluster file's model path.")
@click.option("--address", default=None, help="The cluster file's address: an IP or interface.")
def ring_probe_command(model_dir: str, address: str | None) -> None:
    """What a ring rank here needs, this host's addresses, and a port free on all of them."""
    from cluster.transport.links import interface_address

    connection = os.environ.get("SSH_CONNECTION", "").split()
    ssh_address = connection[2] if len(connection) >= 3 else ""
    if address is not None:
        address = interface_address(address) or address
    port, port_error = 0, ""
    try:  # free on the wildcard address: free on every address of the host
        port = _free_port("::" if address and ":" in address else "0.0.0.0")
        if address:
            _free_port(address, port)
    except OSError as error:
        port_error = f"cannot listen on {address or 'any address'}: {error}"
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 0
    _answer(
        version=__version__,
        hostname=socket.gethostname(),
        ssh_address=ssh_address,
        address=address or "",
        networks=_networks(),
        port=port,
        port_error=port_error,
        mlx_error=_mlx_problem(),
        model_present=(Path(model_dir) / "config.json").is_file(),
        memory_bytes=memory,
    )


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return ""


@click.command("ring-rank")
@click.option("--run-id", required=True)
@click.option("--rank", type=int, required=True)
def ring_rank_command(run_id: str, rank: int) -> None:
    """Run one rank and report how it ended. Stdin: the run's settings as one JSON line, then
    kept open: its end (the bench closing it, or the ssh connection gone) stops the rank."""
    settings = json.loads(sys.stdin.readline() or "null")
    if settings is None:
        raise click.ClickException("no settings on stdin (stopped before it started)")
    hung_up = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        hung_up.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    for stop_signal in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, lambda *_: hung_up.set())
    directory = run_dir(run_id, rank)
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        raise click.ClickException(f"{directory} exists: a run id used twice") from None
    try:
        answer = _run_rank(rank, settings, directory, hung_up)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    click.echo(json.dumps(answer))
    if answer["exit"] != 0:
        sys.exit(1)


def _run_rank(rank: int, settings: dict, directory: Path, hung_up: threading.Event) -> dict:
    from cluster.bench.ring_baseline import worker_argv

    hostfile = directory / "hostfile.json"
    hostfile.write_text(json.dumps(settings["hostfile"]))
    runs = directory / "runs.json"
    runs.write_text(json.dumps(settings["prompt_runs"]))
    out, log = directory / "rank.json", directory / "rank.log"
    argv = worker_argv(
        out, settings["model"], runs, settings["max_tokens"], settings["temperature"],
        settings["seed"],
    )  # fmt: skip
    env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
    with log.open("w") as log_file:
        worker = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stopping kills it whole
        )
    (directory / "pids.json").write_text(json.dumps({"rank": os.getpid(), "worker": worker.pid}))
    deadline = time.monotonic() + float(settings["timeout_s"])
    while (code := worker.poll()) is None:
        if hung_up.wait(POLL_S) or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            break
    connection = os.environ.get("SSH_CONNECTION", "").split()
    return {
        "rank": rank,
        "hostname": socket.gethostname(),
        "ssh_address": connection[2] if len(connection) >= 3 else "",
        "exit": code,
        "timed_out": code is None and not hung_up.is_set(),
        "hung_up": code is None and hung_up.is_set(),
        "report": json.loads(out.read_text()) if code == 0 and rank == 0 else None,
        "log": _tail(log) if code != 0 else "",
    }


def _alive(pid: int, *, group: bool = False) -> bool:
    """Whether the process (or the process group, `group`) still exists."""
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _is_ours(pid: int, run_id: str) -> bool:
    """The pid still runs this run's rank (pids are reused); without /proc, trust the file."""
    try:
        return run_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return True


@click.command("ring-stop")
@click.option("--run-id", required=True)
@click.option("--rank", type=int, required=True)
def ring_stop_command(run_id: str, rank: int) -> None:
    """Kill this run's rank here (worker group first) and delete its files: for a rank whose
    ssh connection is stuck, so that closing its stdin did not reach it."""
    directory = run_dir(run_id, rank)
    try:
        pids = json.loads((directory / "pids.json").read_text())
    except (OSError, ValueError):
        pids = {}
    stopped = []
    worker, ranker = pids.get("worker"), pids.get("rank")
    if worker and _alive(worker, group=True) and _is_ours(worker, run_id):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker, signal.SIGKILL)
        stopped.append(worker)
    if ranker and _alive(ranker) and _is_ours(ranker, run_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranker, signal.SIGKILL)
        stopped.append(ranker)
    deadline = time.monotonic() + STOP_WAIT_S
    while any(_alive(p, group=p == worker) for p in stopped):
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    shutil.rmtree(directory, ignore_errors=True)
    _answer(stopped=stopped)


RING_COMMANDS = (ring_probe_command, ring_rank_command, ring_stop_command)
