"""The round trip to each address of a node, as the hop to it measures them (LinkPing).

    python -m benchmarks.links_bench [--node HOST:PORT --token-file F] [--json OUT]

With `--node`, the node's own list of addresses is timed from this machine (on Macs: which
of Thunderbolt, Ethernet and Wi-Fi is fastest to it). Without, a node is started here on
every interface and its addresses are timed over this machine's own stack. Also prints how
long the whole choice takes (what it adds to a LoadShard).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import free_port, machine, stop, wait_for_port, write_json
from cluster.secret import read_secret
from cluster.transport.hop_choice import choose_hop, join_host_port, round_trips_ms
from cluster.transport.node_client import NodeClient

ROUNDS = 5


async def measure(address: str, token: str) -> dict:
    client = NodeClient(address, token)
    try:
        info = await client.info()
    finally:
        await client.close()
    port = int(address.rsplit(":", 1)[1])
    links = list(info.links)
    addresses = [join_host_port(link.address, port) for link in links]
    rounds = [await round_trips_ms(addresses, info.node_id, token, None) for _ in range(ROUNDS)]
    rows = []
    for i, link in enumerate(links):
        times = [r[i] for r in rounds if r[i] is not None]
        rows.append(
            {
                "address": addresses[i],
                "interface": link.interface,
                "kind": link.kind,
                "rtt_ms": sorted(times)[len(times) // 2] if times else None,
            }
        )
    started = time.perf_counter()
    choice = await choose_hop(address, links, info.node_id, token, None)
    choose_ms = (time.perf_counter() - started) * 1000
    return {"node": info.node_id, "links": rows, "chosen": choice.address, "choose_ms": choose_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--node", help="HOST:PORT of a running node (default: start one here)")
    parser.add_argument("--token-file", type=Path, help="the cluster secret (with --node)")
    parser.add_argument("--json", dest="json_path", help="write the figures here")
    args = parser.parse_args()
    procs = []
    try:
        if args.node:
            if args.token_file is None:
                parser.error("--node needs --token-file")
            address, token = args.node, read_secret(args.token_file)
        else:
            token, port = secrets.token_hex(16), free_port()
            argv = [sys.executable, "-m", "cluster", "node", "--host", "0.0.0.0",
                    "--port", str(port), "--node-id", "links-bench", "--no-advertise",
                    "--token", token]  # fmt: skip
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
            wait_for_port(port, procs[0])
            address = f"127.0.0.1:{port}"
        report = asyncio.run(measure(address, token))
    finally:
        stop(procs)
    print(f"node {report['node']}: median round trip of LinkPing, {ROUNDS}x5 pings each")
    for row in report["links"]:
        rtt = f"{row['rtt_ms']:.3f} ms" if row["rtt_ms"] is not None else "no answer"
        print(f"  {row['address']:<28} {row['interface']:<10} {row['kind']:<12} {rtt}")
    print(f"chosen hop: {report['chosen']} (the choice took {report['choose_ms']:.1f} ms)")
    write_json(args.json_path, {"machine": machine(), **report})


if __name__ == "__main__":
    main()
