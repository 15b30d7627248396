"""`cluster up --hosts FILE` across three pretend Macs (tests/hostlab.py: network namespaces,
each with its own sshd), from the root namespace, as a person runs it.

One lab and one `up` serve the module; the tests run in file order and the last one takes
everything down. Nothing is started on the real network: traffic stays on loopback and the
lab's own addresses.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from cluster.hosts.clusterfile import load_cluster_file
from cluster.transport.node_client import NodeClient
from tests import hostlab
from tests.daemons import NO_WARMUP, START_DEADLINE_S, free_port, wait_until

if (missing := hostlab.available()) is not None:
    # In CI the lab must run (.ci/run installs sshd): a skip there would hide a broken setup.
    if os.environ.get("CI"):
        raise RuntimeError(f"the hosts lab cannot run in CI: {missing}")
    pytest.skip(missing, allow_module_level=True)

MAX_TOKENS = 16
PROMPT = "def fibonacci(n):\n"
ENDPOINT = re.compile(r"OpenAI endpoint: (\S+)/v1")
MODEL = Path(__file__).resolve().parent.parent / "cluster" / "assets" / "qwen3_5-tiny-mtp"


def cluster(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster", *args], capture_output=True, text=True, timeout=timeout
    )


def write_cluster_file(path: Path, lab: hostlab.HostLab, nodes: list[dict[str, str | int]]) -> Path:
    lines = [
        f'model = "{MODEL}"',
        f"port = {free_port()}",
        f'ssh_config = "{lab.ssh_config}"',
        f'secret_file = "{lab.directory / "secret"}"',
    ]
    for node in nodes:
        lines.append("[[node]]")
        lines += [
            f"{key} = {value}" if isinstance(value, int) else f'{key} = "{value}"'
            for key, value in node.items()
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def state_dir(lab: hostlab.HostLab, index: int) -> Path:
    return lab.directory / "state" / f"mac{index}"


def lab_nodes(lab: hostlab.HostLab, command: Path) -> list[dict[str, str]]:
    return [
        {
            "ssh": host.name,
            "name": f"mac{i}",
            "cluster": str(command),
            "service": "process",
            "state_dir": str(state_dir(lab, i)),
        }
        for i, host in enumerate(lab.hosts)
    ]


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append((int(pid), cmdline))
    return found


def lab_supervisors(lab: Lab) -> list[int]:
    """The pids of this lab's node supervisors (another test's lab may run beside it)."""
    state = str(lab.lab.directory / "state")
    found = processes_mentioning("cluster.hosts.supervisor")
    return sorted(pid for pid, cmdline in found if state in cmdline)


@dataclass
class Up:
    process: subprocess.Popen
    log: Path
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_up(cluster_file: Path, log: Path) -> Up:
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster", "up", "--hosts", str(cluster_file), NO_WARMUP],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def endpoint() -> str | None:
        text = log.read_text()
        if process.poll() is not None:
            raise AssertionError(f"cluster up --hosts exited with {process.returncode}:\n{text}")
        match = ENDPOINT.search(text)
        return match.group(1) if match else None

    return Up(process, log, wait_until(endpoint, "cluster up --hosts", START_DEADLINE_S))


@dataclass
class Lab:
    lab: hostlab.HostLab
    cluster_file: Path
    command: Path
    up: Up
    reference: dict


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    directory = tmp_path_factory.mktemp("hosts")
    reference = subprocess.Popen(
        [sys.executable, "-m", "cluster", "generate", "--prompt", PROMPT,
         "--max-tokens", str(MAX_TOKENS), "--json"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    the_lab = hostlab.HostLab(directory / "lab").start()
    state: Lab | None = None
    try:
        command = the_lab.cluster_command()
        cluster_file = write_cluster_file(
            directory / "cluster.toml", the_lab, lab_nodes(the_lab, command)
        )
        up = start_up(cluster_file, directory / "up.log")
        state = Lab(the_lab, cluster_file, command, up, {})
        out, _ = reference.communicate(timeout=60)
        state.reference = json.loads(out)
        yield state
    finally:
        reference.kill()
        if state is not None:  # the `up` of the moment: tests start it again with other files
            state.up.stop()
        if (directory / "cluster.toml").exists():
            cluster("down", "--hosts", str(directory / "cluster.toml"))
        the_lab.close()


def complete(up: Up) -> str:
    client = up.client()
    model = client.models.list().data[0].id
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    return reply.choices[0].text


def test_up_serves_the_single_process_tokens_and_hides_the_secret(lab: Lab):
    assert complete(lab.up) == lab.reference["text"]
    secret = (lab.lab.directory / "secret").read_text().strip()
    assert len(secret) >= 32
    assert processes_mentioning(secret) == []  # on no command line, anywhere
    assert (lab.lab.directory / "secret").stat().st_mode & 0o777 == 0o600
    for i in range(len(lab.lab.hosts)):
        on_host = state_dir(lab.lab, i) / "secret"
        assert on_host.read_text().strip() == secret
        assert on_host.stat().st_mode & 0o777 == 0o600
    text = lab.up.log.read_text()
    assert text.count(": started [process]") == 3, text


def status_json(up: Up) -> dict:
    result = cluster("status", "--url", up.url, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def measured_status(up: Up, deadline_s: float = 30.0) -> dict:
    """The status once no node says its hop is being measured (`hop_state`): a status read
    while shards load shows no hop yet, which is not the hop chosen."""
    return wait_until(
        lambda: (
            (status := status_json(up))["nodes"]
            and all(n["hop_state"] != "measuring" for n in status["nodes"])
            and status
        ),
        "every hop measured",
        deadline_s,
    )


def host_of(lab: Lab, address: str) -> int:
    """Which lab host a node's host:port is on."""
    ip = address.rsplit(":", 1)[0]
    return next(i for i, h in enumerate(lab.lab.hosts) if ip in (h.slow_address, h.fast_address))


def shard_loads(lab: Lab, nodes: list[dict]) -> dict[str, int]:
    """Each node's count of LoadShard calls that loaded weights, asked of the node itself."""
    secret = (lab.lab.directory / "secret").read_text().strip()

    async def ask() -> dict[str, int]:
        counts = {}
        for node in nodes:
            client = NodeClient(node["address"], secret)
            try:
                counts[node["node_id"]] = (await client.info()).shard_loads
            finally:
                await client.close()
        return counts

    return asyncio.run(ask())


def test_every_hop_takes_the_fast_network(lab: Lab):
    """The coordinator dials the nodes at their ssh (slow) addresses; each upstream node
    measured both of its successor's networks and streams over the fast one. The slow
    address's pings took longer: the two are pinged in turn, so a busy machine slows both
    alike, where a bound in ms on the fast one's round trip fails under load."""
    nodes = measured_status(lab.up)["nodes"]
    slow = {h.slow_address for h in lab.lab.hosts}
    assert {n["address"].rsplit(":", 1)[0] for n in nodes} == slow
    for node, successor in itertools.pairwise(nodes):
        hop = node["hop"]
        fast = lab.lab.hosts[host_of(lab, successor["address"])].fast_address
        assert hop["measured"] and hop["address"].startswith(fast + ":"), node
        assert hop["kind"] == "ethernet" and hop["rtt_ms"] > 0, node
        tried = dict(hop["tried"])
        assert tried.keys() == {hop["address"], successor["address"]}, node
        assert tried[hop["address"]] == hop["rtt_ms"], node
        assert tried[successor["address"]] > hop["rtt_ms"], node
    assert nodes[-1]["hop"] is None
    assert [n["hop_state"] for n in nodes] == ["measured", "measured", ""]
    table = cluster("status", "--url", lab.up.url).stdout
    assert table.count(" ms)") == 2 and "-> " in table and "measuring" not in table, table
    # The lab's hosts are Linux: no node holds anything awake, and the status says why.
    assert not any(n["keeps_awake"] for n in nodes)
    assert all(n["keep_awake_note"].startswith("not macOS") for n in nodes), nodes
    assert "keeping their Mac awake: none; not: " in table, table


def test_a_restarted_coordinator_adopts_the_loaded_nodes(lab: Lab):
    """Ctrl-C to the coordinator in the middle of a request; the nodes stay; `up` again finds
    them up and serves the next request without a single LoadShard."""
    nodes = status_json(lab.up)["nodes"]
    loads = shard_loads(lab, nodes)
    assert set(loads.values()) == {1}
    supervisors = lab_supervisors(lab)
    client = lab.up.client()
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    next(iter(stream))  # the request is running on the nodes
    lab.up.stop()
    assert lab_supervisors(lab) == supervisors
    lab.up = start_up(lab.cluster_file, lab.up.log.with_name("up-again.log"))
    text = lab.up.log.read_text()
    assert text.count(": running [process]") == 3, text
    assert complete(lab.up) == lab.reference["text"]
    assert shard_loads(lab, nodes) == loads
    assert lab_supervisors(lab) == supervisors


def test_an_address_in_the_cluster_file_wins_over_measuring(lab: Lab):
    """The tail's address given as an interface (its slow one): its upstream streams there."""
    tail = host_of(lab, status_json(lab.up)["nodes"][-1]["address"])
    nodes = lab_nodes(lab.lab, lab.command)
    nodes[tail]["address"] = "slow0"
    pinned = write_cluster_file(lab.cluster_file.with_name("pinned.toml"), lab.lab, nodes)
    lab.up.stop()
    lab.up = start_up(pinned, lab.up.log.with_name("up-pinned.log"))
    statuses = measured_status(lab.up)["nodes"]
    assert host_of(lab, statuses[-1]["address"]) == tail
    hops = [n["hop"] for n in statuses]
    assert [n["hop_state"] for n in statuses] == ["measured", "given", ""]
    assert hops[0]["measured"] and not hops[1]["measured"]
    assert hops[1]["address"].startswith(lab.lab.hosts[tail].slow_address + ":")
    assert complete(lab.up) == lab.reference["text"]


def test_ip_address_targets_without_names_bring_up_three_hosts(lab: Lab, tmp_path: Path):
    """`ssh = "root@ADDRESS"` and no `name`, as people write cluster files: each node is named
    by its whole address (its node id, its service and its state directory on the host), on
    a port beside the lab's own nodes, and serves the single process's tokens."""
    port = free_port()
    nodes: list[dict[str, str | int]] = [
        {"ssh": f"root@{h.slow_address}", "port": port, "cluster": str(lab.command),
         "service": "process"}
        for h in lab.lab.hosts
    ]  # fmt: skip
    cluster_file = write_cluster_file(tmp_path / "by-address.toml", lab.lab, nodes)
    names = [h.slow_address for h in lab.lab.hosts]
    assert [n.name for n in load_cluster_file(cluster_file).nodes] == names
    # The hosts' default state directories: root's, over ssh (no XDG_STATE_HOME there).
    states = [Path("~root/.local/state/qwencluster").expanduser() / name for name in names]
    try:
        up = start_up(cluster_file, tmp_path / "up-by-address.log")
        try:
            text = up.log.read_text()
            for name in names:
                assert f"{name} (root@{name}) at {name}:{port}: started [process]" in text, text
            assert sorted(n["node_id"] for n in status_json(up)["nodes"]) == sorted(names)
            assert all(state.is_dir() for state in states)
            assert complete(up) == lab.reference["text"]
        finally:
            up.stop()
    finally:
        down = cluster("down", "--hosts", str(cluster_file))
    assert down.returncode == 0 and down.stdout.count(": removed") == 3, down
    assert not any(state.exists() for state in states)
    assert processes_mentioning(f"--port {port} ") == []


def test_bad_hosts_are_each_named_and_nothing_is_started(lab: Lab, tmp_path: Path):
    """One host refuses ssh, one lacks the project, one has another version: one `up` names
    each with what to do, within seconds, and starts nothing anywhere."""
    nodes = lab_nodes(lab.lab, lab.command)
    nodes = [
        {**n, "name": f"bad{i}", "state_dir": str(tmp_path / f"bad{i}")}
        for i, n in enumerate(nodes)
    ]
    nodes[0]["ssh"] = f"lab{lab.lab.tag}-refusing"
    nodes[1]["cluster"] = str(tmp_path / "nowhere" / "cluster")
    old = tmp_path / "old-cluster"
    old.write_text('#!/bin/sh\necho \'{"version": "0.0.1"}\'\n')
    old.chmod(0o755)
    nodes[2]["cluster"] = str(old)
    nodes.append(
        {**lab_nodes(lab.lab, lab.command)[0], "name": "good", "state_dir": str(tmp_path / "good")}
    )
    cluster_file = write_cluster_file(tmp_path / "bad.toml", lab.lab, nodes)
    started = time.monotonic()
    result = cluster("up", "--hosts", str(cluster_file))
    assert time.monotonic() - started < 30
    assert result.returncode != 0
    errors = result.stderr
    assert f"host {nodes[0]['ssh']!r}: ssh cannot reach it" in errors, errors
    assert f"host {nodes[1]['ssh']!r}: the project is not installed there" in errors, errors
    assert f"host {nodes[2]['ssh']!r} has cluster 0.0.1, this machine" in errors, errors
    assert "install the same version" in errors and "nothing was started" in errors
    assert not any(tmp_path.glob("bad[0-9]")) and not (tmp_path / "good").exists()
    assert processes_mentioning(str(tmp_path)) == []


def test_bench_runs_on_the_hosts_of_the_cluster_file(lab: Lab, tmp_path: Path):
    """`cluster bench --hosts` brings the cluster up the way `cluster up --hosts` does (it finds
    the node services running) and measures it; the lab's own `up` makes way meanwhile."""
    lab.up.stop()
    out = tmp_path / "bench"
    result = cluster(
        "bench", "--hosts", str(lab.cluster_file), "--prompt-tokens", "16",
        "--concurrency", "1", "--max-tokens", "8", "--sampling", "greedy", "--mtp", "on",
        "--baseline", "ring", "--out", str(out), timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = json.loads((out / "bench.json").read_text())
    assert run["settings"]["hosts_file"] == str(lab.cluster_file)
    (scenario,) = run["scenarios"]
    assert [r["completion_tokens"] for r in scenario["requests"]] == [8, 8]
    assert [r["prompt_tokens"] for r in scenario["requests"]] == [16, 16]
    assert len(scenario["nodes"]) == 3
    # mlx-lm's ring pipeline ran one rank on each lab host, reached through the cluster
    # file's ssh settings (the slow network), its ring on the fast network that the pipeline
    # streams over: at the hops' addresses, and the head at its address on that network.
    ring = run["baselines"]["ring"]
    assert "error" not in ring and "skipped" not in ring, ring
    assert [h["ssh_address"] for h in ring["hosts"]] == [h.slow_address for h in lab.lab.hosts]
    # (An earlier test pinned the tail's hop to the slow network; the nodes kept it.)
    pipeline = run["hardware"]
    hop_ip = {n["node_id"]: n["hop"]["address"].rsplit(":", 1)[0] for n in pipeline if n["hop"]}
    into = {b["node_id"]: hop_ip[a["node_id"]] for a, b in itertools.pairwise(pipeline)}
    head = pipeline[0]["node_id"]
    for i, rank in enumerate(ring["hosts"]):
        ip = rank["ring_address"].rsplit(":", 1)[0]
        host = lab.lab.hosts[i]
        if f"mac{i}" == head:  # on the network of the hop it streams over itself
            assert rank["address_from"] == "hops' network"
            assert ip in (host.fast_address, host.slow_address)
            assert ip.rsplit(".", 1)[0] == hop_ip[head].rsplit(".", 1)[0], (ip, hop_ip)  # /24
        else:
            assert (rank["address_from"], ip) == ("pipeline hop", into[f"mac{i}"])
    assert {h.fast_address for h in lab.lab.hosts} & {
        r["ring_address"].rsplit(":", 1)[0] for r in ring["hosts"]
    }
    (base,) = ring["runs"]
    assert base["generated"] == 8 and base["decode_tps"] > 0 and base["ttft_ms"] > 0
    assert scenario["ratios"]["ring"]["output_throughput"] > 0
    assert not list(Path(tempfile.gettempdir()).glob("qwencluster-ring-*"))
    assert processes_mentioning("cluster.bench.ring_baseline") == []
    lab.up = start_up(lab.cluster_file, lab.up.log.with_name("up-after-bench.log"))


def ring_prompt(length: int) -> dict[int, tuple[int, ...]]:
    from mlx_lm.tokenizer_utils import load

    from cluster.bench.workload import PromptSource

    return {length: PromptSource(load(MODEL)).take(length)}


def namespace_of(pid: int) -> str:
    return subprocess.run(
        ["ip", "netns", "identify", str(pid)], capture_output=True, text=True
    ).stdout.strip()


def test_a_ring_rank_that_dies_stops_the_ring_on_every_host(lab: Lab):
    """The ranks run inside the hosts' namespaces; one killed mid-run gives an error naming
    its host, and no rank (nor its files) is left on any host."""
    from cluster.bench import baselines

    cluster_file = load_cluster_file(lab.cluster_file)
    result: dict = {}
    run = threading.Thread(
        target=lambda: result.update(
            baselines.ring_hosts_baseline(cluster_file, ring_prompt(16), [(16, False)], 2000, 0)
        )
    )
    run.start()
    try:
        workers = wait_until(
            lambda: (
                result
                or (
                    len(found := processes_mentioning("cluster.bench.ring_baseline --worker")) == 3
                    and found
                )
            ),
            "three ring ranks",
            60.0,
        )
        assert not result, result  # the ring must not have ended (or failed) by itself
        namespaces = {namespace_of(pid): pid for pid, _ in workers}
        assert set(namespaces) == {h.namespace for h in lab.lab.hosts}
        os.kill(namespaces[lab.lab.hosts[1].namespace], signal.SIGKILL)
    finally:
        run.join(timeout=60)
    error = result["error"]
    assert f"host {lab.lab.hosts[1].name!r} (rank 1): the rank exited with -9" in error, error
    assert "the ranks were stopped on every host" in error
    assert processes_mentioning("cluster.bench.ring_baseline") == []
    assert processes_mentioning("ring-rank") == []
    assert not list(Path(tempfile.gettempdir()).glob("qwencluster-ring-*"))


def test_a_ring_past_its_deadline_is_stopped_on_every_host(lab: Lab):
    """Each rank's own deadline (here 1 s: less than a load takes) kills it there; the error
    says so, and no rank or file is left on any host."""
    from cluster.bench.ring_hosts import RingHostsError, probe_hosts, run_ring_on_hosts
    from cluster.hosts.ssh import SSH

    cluster_file = load_cluster_file(lab.cluster_file)
    ssh = SSH(cluster_file.ssh_config)
    hosts = probe_hosts(cluster_file, ssh)
    (ids,) = ring_prompt(16).values()
    with pytest.raises(RingHostsError) as failed:
        run_ring_on_hosts(
            cluster_file, hosts, [(list(ids), False)], max_tokens=8, seed=0, temperature=0.0,
            timeout_s=1.0, ssh=ssh,
        )  # fmt: skip
    assert "the rank did not finish within its deadline" in str(failed.value), failed.value
    assert "the ranks were stopped on every host" in str(failed.value)
    assert processes_mentioning("cluster.bench.ring_baseline") == []
    assert processes_mentioning("ring-rank") == []
    assert not list(Path(tempfile.gettempdir()).glob("qwencluster-ring-*"))


def test_a_host_that_cannot_listen_for_the_ring_is_named_and_no_rank_starts(
    lab: Lab, tmp_path: Path
):
    """A node whose cluster-file address is not on its host: the probe finds that the rank
    could not listen there, names the host, and nothing starts anywhere."""
    from cluster.bench import baselines

    nodes = lab_nodes(lab.lab, lab.command)
    nodes[2]["address"] = "198.51.100.7"  # TEST-NET-2: on no host
    cluster_file = load_cluster_file(write_cluster_file(tmp_path / "away.toml", lab.lab, nodes))
    result = baselines.ring_hosts_baseline(cluster_file, ring_prompt(16), [(16, False)], 8, 0)
    error = result["error"]
    assert f"host {lab.lab.hosts[2].name!r}: cannot listen on 198.51.100.7: " in error, error
    assert "no rank was started" in error and "Traceback" not in error
    assert lab.lab.hosts[0].name not in error and lab.lab.hosts[1].name not in error
    assert processes_mentioning("cluster.bench.ring_baseline") == []


def test_down_leaves_nothing_behind(lab: Lab):
    lab.up.stop()
    result = cluster("down", "--hosts", str(lab.cluster_file))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": removed") == 3, result.stdout
    for i, host in enumerate(lab.lab.hosts):
        assert not state_dir(lab.lab, i).exists()
        pids = subprocess.run(
            ["ip", "netns", "pids", host.namespace], capture_output=True, text=True
        ).stdout.split()
        commands = [Path(f"/proc/{p}/cmdline").read_bytes() for p in pids]
        assert all(b"sshd" in c for c in commands), commands  # only the lab's own sshd
    assert processes_mentioning(str(lab.lab.directory / "state")) == []
