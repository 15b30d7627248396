"""mlx-lm's ring pipeline over the hosts of a cluster file (`cluster bench --hosts FILE
--baseline ring`): one rank per `[[node]]` host, in the file's order.

The ranks are started over the project's own ssh (the cluster file's `ssh_config`, BatchMode,
the hosts in parallel), not by `mlx.launch`, whose plain `ssh -tt HOST` would ignore the
cluster file's ssh settings. Each host runs `cluster hosts ring-rank` of its own installation
(the node's `cluster` command, as `cluster up --hosts` does), which starts the rank the way
`mlx.launch --backend ring` would (MLX_RANK, and MLX_HOSTFILE holding every rank's ip:port)
with that installation's Python (`cluster.bench.ring_rank`). Every rank loads its share of the
layers with mlx-lm's `sharded_load` from the model path of the cluster file, on its own host.

Before anything starts, every host is probed: the project's version, mlx and mlx-lm there,
the model at that path, its memory, its addresses and a port free on all of them. Each rank
listens (never on 127.0.0.1) on the node's `address` from the cluster file (an interface is
resolved on the host); else where the running pipeline streams to that host (the link its
predecessor measured best); for the head, on the network of the hop it streams over itself;
and without a pipeline on the address ssh reached. Rank 0 (mlx-lm gives it the last layers)
prints its figures on its ssh's stdout; no shared filesystem is assumed. A rank lives as long
as its ssh's stdin: when a rank fails or the run outlives its deadline, closing every stdin
kills every rank on its host (`cluster hosts ring-stop` over a new ssh where that does not
reach), and the error names the host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster import __version__
from cluster.hosts.bringup import BringUpError, dial_address, hosts_command
from cluster.hosts.clusterfile import ClusterFile, HostNode
from cluster.hosts.ssh import SSH, SSH_FAILED, in_parallel, remote_words

RING_TIMEOUT_S = 300.0
MARGIN_S = 20.0  # this side waits that much longer than the ranks' own deadline
POLL_S = 0.1
STOP_WAIT_S = 10.0  # for a rank's ssh to end once its stdin is closed
LOG_LINES = 3  # of a failed rank's output, in the error


class RingHostsError(RuntimeError):
    """The ring did not run; the message names each host and what went wrong there."""


@dataclass(frozen=True, slots=True)
class RingHost:
    rank: int
    node: HostNode
    hostname: str
    address: str  # where the rank listens for its ring neighbours ("" until chosen)
    address_from: str  # why that address: cluster file, pipeline hop, hops' network, ssh
    port: int
    memory_bytes: int
    ssh_address: str
    networks: tuple[ipaddress.IPv4Interface, ...]  # the host's IPv4 addresses with prefixes

    @property
    def endpoint(self) -> str:
        return dial_address(self.address, self.port)


def _probe(
    ssh: SSH, cluster: ClusterFile, rank: int, node: HostNode, streamed_to: str | None
) -> RingHost:
    args = ["ring-probe", "--model", str(cluster.model)]
    if node.address is not None:
        args += ["--address", node.address]
    answer = hosts_command(ssh, node, *args, timeout=60.0)
    where = f"host {node.ssh!r}"
    if answer.get("version") != __version__:
        raise RingHostsError(
            f"{where} has cluster {answer.get('version')}, this machine {__version__}: install "
            "the same version on both"
        )
    if answer["mlx_error"]:
        raise RingHostsError(f"{where}: {answer['mlx_error']}; install mlx-lm there")
    if not answer["model_present"]:
        raise RingHostsError(
            f"{where}: no model at {cluster.model}; mlx-lm's ring ranks load it from disk, so "
            "copy the model to that path there"
        )
    if answer["port_error"]:
        raise RingHostsError(f"{where}: {answer['port_error']}")
    if answer["address"]:
        address, source = answer["address"], "cluster file"
    elif streamed_to:
        address, source = streamed_to, "pipeline hop"
    else:
        address, source = "", ""
    return RingHost(
        rank,
        node,
        answer["hostname"],
        address,
        source,
        answer["port"],
        answer["memory_bytes"],
        answer["ssh_address"],
        tuple(ipaddress.IPv4Interface(f"{n['address']}/{n['prefix']}") for n in answer["networks"]),
    )


def choose_address(host: RingHost, preferred: list[str]) -> RingHost:
    """For a host the pipeline does not stream to (the head): its address on the network of
    the first of `preferred` it shares one with (the address it streams to itself first, then
    the other ranks'), so that the ring takes the links the pipeline measured best; else the
    address ssh reached."""
    if host.address:
        return host
    for other in preferred:
        if not other or ":" in other:
            continue
        for interface in host.networks:
            if ipaddress.ip_address(other) in interface.network:
                return replace(host, address=str(interface.ip), address_from="hops' network")
    if host.ssh_address:
        return replace(host, address=host.ssh_address, address_from="ssh")
    raise RingHostsError(
        f'host {host.node.ssh!r}: cannot tell its address for the ring; give address = "..." '
        "in its [[node]] table"
    )


def _hop_ip(node: dict[str, Any]) -> str:
    hop = node.get("hop") or {}
    return hop["address"].rsplit(":", 1)[0].strip("[]") if hop.get("address") else ""


def streamed_to(pipeline: list[dict[str, Any]]) -> dict[str, str]:
    """Node id -> the address its predecessor in the running pipeline streams to (`hop`:
    the link it measured best, or the cluster file's), from the bench's `hardware`."""
    return {
        successor["node_id"]: _hop_ip(node)
        for node, successor in itertools.pairwise(pipeline)
        if _hop_ip(node)
    }


def probe_hosts(
    cluster: ClusterFile, ssh: SSH, pipeline: list[dict[str, Any]] | None = None
) -> list[RingHost]:
    """Every host's readiness for a rank and its ring address, all at once; one error naming
    each host that is not ready. `pipeline`: the running cluster's nodes, head first."""
    hops = streamed_to(pipeline or [])
    results = in_parallel(
        lambda pair: _probe(ssh, cluster, *pair, hops.get(pair[1].name)),
        list(enumerate(cluster.nodes)),
    )
    failures = [
        str(r) if isinstance(r, RingHostsError | BringUpError) else f"host {n.ssh!r}: {r}"
        for n, r in zip(cluster.nodes, results, strict=True)
        if isinstance(r, BaseException)
    ]
    if not failures:
        own = {n["node_id"]: _hop_ip(n) for n in pipeline or []}
        chosen = [h.address for h in results if h.address]  # type: ignore[union-attr]
        results = in_parallel(
            lambda h: choose_address(h, [own.get(h.node.name, ""), *chosen]), results
        )
        failures = [str(r) for r in results if isinstance(r, BaseException)]
    if failures:
        raise RingHostsError("\n".join(failures) + "\nno rank was started")
    return results  # type: ignore[return-value]


def rank_bytes(model_dir: Path, ranks: int) -> list[int]:
    """The weight bytes each rank loads: mlx-lm's even split of the layers (rank 0 the last,
    the low ranks one extra), and on every rank the embedding, final norm and lm_head."""
    from cluster.model.footprint import ModelFootprint

    footprint = ModelFootprint.from_dir(model_dir)
    layers = footprint.layer_weight_bytes
    base, extra = divmod(len(layers), ranks)
    split = [base + (1 if r < extra else 0) for r in range(ranks)]
    shared = footprint.embed_bytes + footprint.lm_head_bytes + footprint.final_norm_bytes
    out = []
    for rank in range(ranks):
        start = sum(split[rank + 1 :])
        out.append(sum(layers[start : start + split[rank]]) + shared)
    return out


def why_it_does_not_fit(model_dir: Path, hosts: list[RingHost], share: float) -> str | None:
    """The ring needs each rank's share of the model to fit its host (the hosts together, not
    one machine); a node's `memory_gb` caps what its host offers."""
    from cluster.model.footprint import ModelFootprint

    layers = len(ModelFootprint.from_dir(model_dir).layer_weight_bytes)
    if len(hosts) > layers:
        return f"mlx-lm's pipeline needs at most one rank per layer ({layers}), not {len(hosts)}"
    for host, need in zip(hosts, rank_bytes(model_dir, len(hosts)), strict=True):
        cap = host.node.memory_gb * 1e9 if host.node.memory_gb is not None else None
        memory = min(host.memory_bytes, cap) if cap is not None else host.memory_bytes
        if memory and need > share * memory:
            return (
                f"rank {host.rank}'s share of the model ({need / 1e9:.1f} GB) does not fit "
                f"host {host.node.ssh!r} ({memory / 1e9:.1f} GB)"
            )
    return None


@dataclass
class _Rank:
    host: RingHost
    proc: subprocess.Popen
    stdout: Any
    stderr: Any

    def answer(self) -> dict | None:
        self.stdout.seek(0)
        lines = self.stdout.read().strip().splitlines()
        with contextlib.suppress(ValueError, IndexError):
            return json.loads(lines[-1])
        return None

    def failure(self) -> str:
        where = f"host {self.host.node.ssh!r} (rank {self.host.rank})"
        answer = self.answer()
        self.stderr.seek(0)
        stderr = self.stderr.read().strip()
        if answer is None:
            if self.proc.returncode == SSH_FAILED:
                detail = (stderr.splitlines() or ["no detail"])[-1]
                return f"{where}: ssh lost it ({detail})"
            if "Traceback (most recent call last)" in stderr:  # its exception says what
                stderr = stderr.splitlines()[-1]
            return f"{where}: `cluster hosts ring-rank` exited with {self.proc.returncode}: " + (
                stderr[-800:] or "no output"
            )
        if answer["timed_out"]:
            return f"{where}: the rank did not finish within its deadline"
        said = "\n".join(answer["log"].strip().splitlines()[-LOG_LINES:]) or "no output"
        return f"{where}: the rank exited with {answer['exit']}; its last lines:\n{said}"


def _start(ssh: SSH, host: RingHost, run_id: str, settings: dict) -> _Rank:
    remote = remote_words(
        host.node.cluster, "hosts", "ring-rank", "--run-id", run_id, "--rank", str(host.rank)
    )
    stdout = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by the caller
    stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(
        ssh.argv(host.node.ssh, remote),
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=stderr,
        text=True,
        start_new_session=True,  # Ctrl-C reaches this process, which then stops the ranks
    )
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # kept open: the rank lives while it is
        proc.stdin.write(json.dumps(settings) + "\n")
        proc.stdin.flush()
    return _Rank(host, proc, stdout, stderr)


def _stop(ssh: SSH, ranks: list[_Rank], run_id: str) -> list[str]:
    """Stop every rank still running: closing its stdin makes it kill itself on its host;
    where its ssh does not end within STOP_WAIT_S (a stuck connection), `ring-stop` over a
    new one. What could not be stopped."""
    for rank in ranks:
        with contextlib.suppress(OSError):
            rank.proc.stdin.close()
    deadline = time.monotonic() + STOP_WAIT_S
    while any(r.proc.poll() is None for r in ranks) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    stuck = [r for r in ranks if r.proc.poll() is None]

    def stop(rank: _Rank) -> dict:
        args = ["ring-stop", "--run-id", run_id, "--rank", str(rank.host.rank)]
        return hosts_command(ssh, rank.host.node, *args)

    results = in_parallel(stop, stuck)
    for rank in stuck:
        rank.proc.kill()
        rank.proc.wait()
    return [
        f"could not stop rank {r.host.rank} on host {r.host.node.ssh!r}: {result}"
        for r, result in zip(stuck, results, strict=True)
        if isinstance(result, BaseException)
    ]


def _wait(ranks: list[_Rank], timeout_s: float) -> list[dict | None]:
    """Every rank's answer once all succeeded; a RingHostsError at the first failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [rank.proc.poll() for rank in ranks]
        failed = [r for r, code in zip(ranks, codes, strict=True) if code not in (None, 0)]
        if failed:
            raise RingHostsError("\n".join(r.failure() for r in failed))
        if all(code == 0 for code in codes):
            return [rank.answer() for rank in ranks]
        if time.monotonic() > deadline:
            running = [r.host.node.ssh for r, c in zip(ranks, codes, strict=True) if c is None]
            raise RingHostsError(
                f"the ring did not finish within {timeout_s:.0f} s (still running on "
                f"{', '.join(running)})"
            )
        time.sleep(POLL_S)


def run_ring_on_hosts(
    cluster: ClusterFile,
    hosts: list[RingHost],
    prompt_runs: list[tuple[list[int], bool]],
    *,
    max_tokens: int,
    seed: int,
    temperature: float,
    timeout_s: float = RING_TIMEOUT_S,
    ssh: SSH | None = None,
) -> dict[str, Any]:
    """Run the ring on the probed hosts; rank 0's report (its `runs` in prompt_runs' order)
    and each rank's host. Raises RingHostsError, with no rank left running anywhere."""
    ssh = ssh or SSH(cluster.ssh_config)
    run_id = uuid.uuid4().hex[:16]
    settings = {
        "hostfile": [[host.endpoint] for host in hosts],
        "model": str(cluster.model),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "prompt_runs": prompt_runs,
        "timeout_s": timeout_s,
    }
    ranks: list[_Rank] = []
    answers: list[dict | None] = []
    failure: RingHostsError | None = None
    leftovers: list[str] = []
    try:
        for host in hosts:
            ranks.append(_start(ssh, host, run_id, settings))
        answers = _wait(ranks, timeout_s + MARGIN_S)
    except RingHostsError as error:
        failure = error
    finally:  # failed, timed out or interrupted: no rank stays behind
        leftovers = _stop(ssh, ranks, run_id)
        for rank in ranks:
            rank.stdout.close()
            rank.stderr.close()
    if failure is not None:
        raise RingHostsError(
            "\n".join([str(failure), *leftovers, "the ranks were stopped on every host"])
        )
    report = answers[0]["report"] if answers[0] else None
    if not report:
        raise RingHostsError(f"rank 0 on host {hosts[0].node.ssh!r} reported no figures")
    return report | {
        "hosts": [
            {
                "rank": host.rank,
                "host": host.node.ssh,
                "hostname": answer["hostname"],
                "ssh_address": answer["ssh_address"],
                "ring_address": host.endpoint,
                "address_from": host.address_from,
            }
            for host, answer in zip(hosts, answers, strict=True)
        ]
    }
