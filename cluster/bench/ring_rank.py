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
            file it wrote on this host (no shared filesystem), or the rank's log on failure
ring-stop   kills a run's rank here (its process group) and deletes its files

The run's settings come on stdin. Everything of a run lives in one directory per run and rank
under the temp directory, named by the run id, so ring-stop finds exactly what ring-rank
started. Each command prints one JSON object; nothing here imports MLX except the check.
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
import time
from pathlib import Path

import click

from cluster import __version__

RUN_ID = re.compile(r"^[0-9a-f]{8,32}$")
STOP_WAIT_S = 5.0
LOG_TAIL_CHARS = 1500
TOMBSTONE_AGE_S = 3600.0


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
        import mlx_lm  # noqa: F401
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
    from node.links import interface_address

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


STOPPED = "stopped"  # ring-stop came first: the rank must not start


@click.command("ring-rank")
@click.option("--run-id", required=True)
@click.option("--rank", type=int, required=True)
def ring_rank_command(run_id: str, rank: int) -> None:
    """Run one rank (the run's settings as JSON on stdin) and report how it ended."""
    settings = json.loads(sys.stdin.read())
    directory = run_dir(run_id, rank)
    worker: subprocess.Popen | None = None

    def stop(*_: object) -> None:  # ring-stop's SIGTERM, or the ssh session hanging up
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        shutil.rmtree(directory, ignore_errors=True)
        sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        if (directory / STOPPED).exists():
            shutil.rmtree(directory, ignore_errors=True)
            raise click.ClickException("stopped before it started") from None
        raise click.ClickException(f"{directory} exists: a run id used twice") from None
    pids = directory / "pids.json"
    pids.write_text(json.dumps({"rank": os.getpid()}))
    hostfile = directory / "hostfile.json"
    hostfile.write_text(json.dumps(settings["hostfile"]))
    runs = directory / "runs.json"
    runs.write_text(json.dumps(settings["prompt_runs"]))
    out, log = directory / "rank.json", directory / "rank.log"
    argv = [
        sys.executable, "-m", "cluster.bench.ring_baseline", "--worker",
        "--out", str(out), "--model", settings["model"],
        "--max-tokens", str(settings["max_tokens"]), "--temperature", str(settings["temperature"]),
        "--seed-base", str(settings["seed"]), "--prompt-runs", str(runs),
    ]  # fmt: skip
    env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
    signals = {signal.SIGTERM, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # `worker` is set before stop() runs
    with log.open("w") as log_file:
        worker = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: ring-stop and the deadline kill it whole
        )
    pids.write_text(json.dumps({"rank": os.getpid(), "worker": worker.pid}))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    try:
        code = worker.wait(timeout=float(settings["timeout_s"]))
    except subprocess.TimeoutExpired:
        code = None
    try:
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        report = json.loads(out.read_text()) if code == 0 and rank == 0 else None
        connection = os.environ.get("SSH_CONNECTION", "").split()
        _answer(
            rank=rank,
            hostname=socket.gethostname(),
            ssh_address=connection[2] if len(connection) >= 3 else "",
            exit=code,
            timed_out=code is None,
            report=report,
            log=_tail(log) if code != 0 else "",
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if code != 0:
        sys.exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
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


def _forget_old_tombstones() -> None:
    """Tombstones whose rank never came (its ssh died first) go after TOMBSTONE_AGE_S."""
    for tombstone in Path(tempfile.gettempdir()).glob(f"qwencluster-ring-*/{STOPPED}"):
        with contextlib.suppress(OSError):
            if time.time() - tombstone.stat().st_mtime > TOMBSTONE_AGE_S:
                shutil.rmtree(tombstone.parent, ignore_errors=True)


@click.command("ring-stop")
@click.option("--run-id", required=True)
@click.option("--rank", type=int, required=True)
def ring_stop_command(run_id: str, rank: int) -> None:
    """Kill this run's rank here (worker group first) and delete its files; a rank that has
    not started yet finds a tombstone and does not start."""
    directory = run_dir(run_id, rank)
    _forget_old_tombstones()
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        pass
    else:
        (directory / STOPPED).touch()
        _answer(stopped=[], before_start=True)
        return
    pids: dict = {}
    deadline = time.monotonic() + STOP_WAIT_S
    while not pids and time.monotonic() < deadline and directory.exists():
        with contextlib.suppress(OSError, ValueError):
            pids = json.loads((directory / "pids.json").read_text())
        if not pids:
            time.sleep(0.05)
    stopped = []
    worker, ranker = pids.get("worker"), pids.get("rank")
    if worker and _group_alive(worker) and _is_ours(worker, run_id):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker, signal.SIGKILL)
        stopped.append(worker)
    if ranker and _alive(ranker) and _is_ours(ranker, run_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranker, signal.SIGTERM)  # it kills a worker started meanwhile
        stopped.append(ranker)
    deadline = time.monotonic() + STOP_WAIT_S
    while any(_group_alive(p) if p == worker else _alive(p) for p in stopped):
        if time.monotonic() > deadline:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    shutil.rmtree(directory, ignore_errors=True)
    _answer(stopped=stopped, before_start=False)


RING_COMMANDS = (ring_probe_command, ring_rank_command, ring_stop_command)
