"""The choices `cluster bench --hosts --baseline ring` makes before it starts a rank: whether
each rank's share fits its host, and where each rank listens. (The ring itself runs in the
namespace lab: tests/test_hosts_cluster.py.)"""

from __future__ import annotations

import ipaddress

from cluster.bench.ring_hosts import (
    RingHost,
    choose_address,
    rank_bytes,
    streamed_to,
    why_it_does_not_fit,
)
from cluster.config import bundled_model_path
from cluster.hosts.clusterfile import HostNode
from cluster.model.footprint import ModelFootprint

MODEL = bundled_model_path()


def host(rank: int, memory_gb: float | None = None, **fields) -> RingHost:
    defaults = {
        "hostname": f"mac{rank}",
        "address": "",
        "address_from": "",
        "port": 40000 + rank,
        "memory_bytes": 64 * 10**9,
        "ssh_address": f"192.168.1.{rank + 1}",
        "networks": (
            ipaddress.IPv4Interface(f"192.168.1.{rank + 1}/24"),
            ipaddress.IPv4Interface(f"169.254.7.{rank + 1}/16"),
        ),
    }
    node = HostNode(ssh=f"mac{rank}.local", name=f"mac{rank}", memory_gb=memory_gb)
    return RingHost(rank, node, **(defaults | fields))


def test_each_rank_loads_its_layers_and_the_shared_tensors():
    footprint = ModelFootprint.from_dir(MODEL)
    layers = footprint.layer_weight_bytes
    shared = footprint.embed_bytes + footprint.lm_head_bytes + footprint.final_norm_bytes
    per_rank = rank_bytes(MODEL, 3)  # 8 layers: ranks 0 and 1 hold 3, rank 2 the first 2
    assert per_rank == [
        sum(layers[5:8]) + shared,
        sum(layers[2:5]) + shared,
        sum(layers[0:2]) + shared,
    ]


def test_the_ring_must_fit_each_host_not_one_machine():
    need = max(rank_bytes(MODEL, 2))
    roomy = [host(0, memory_gb=need / 1e9), host(1, memory_gb=need / 1e9)]
    assert why_it_does_not_fit(MODEL, roomy, share=1.0) is None
    tight = [host(0), host(1, memory_gb=need / 2 / 1e9)]
    reason = why_it_does_not_fit(MODEL, tight, share=1.0)
    assert reason is not None and "does not fit host 'mac1.local'" in reason, reason
    nine = [host(r) for r in range(9)]
    assert "at most one rank per layer (8), not 9" in why_it_does_not_fit(MODEL, nine, 1.0)


def test_ranks_listen_on_the_links_the_pipeline_streams_over():
    """mac1 -> mac2 -> mac0 stream over the 169.254 (Thunderbolt) network; ssh came over
    192.168.1. The ranks the pipeline streams to take those addresses; the head takes its
    address on the network of the hop it streams over itself."""
    pipeline = [
        {"node_id": "mac1", "hop": {"address": "169.254.7.3:50151"}},
        {"node_id": "mac2", "hop": {"address": "169.254.7.1:50151"}},
        {"node_id": "mac0", "hop": None},
    ]
    into = streamed_to(pipeline)
    assert into == {"mac2": "169.254.7.3", "mac0": "169.254.7.1"}
    head = choose_address(host(1), ["169.254.7.3", "169.254.7.1"])
    assert (head.address, head.address_from) == ("169.254.7.2", "hops' network")
    assert head.endpoint == "169.254.7.2:40001"


def test_without_a_pipeline_the_ring_takes_the_ssh_address():
    alone = choose_address(host(0, networks=()), ["", "10.0.0.9"])
    assert (alone.address, alone.address_from) == ("192.168.1.1", "ssh")
    given = choose_address(host(0, address="10.1.1.1", address_from="cluster file"), [])
    assert (given.address, given.address_from) == ("10.1.1.1", "cluster file")
