"""A node daemon whose tail accepts each MTP draft with a fixed probability (benchmarks only).

    python -m cluster.bench.oracle_node --host 127.0.0.1 --port P --token T --accept-rate 0.7

A model with random weights drafts tokens its backbone almost never agrees with, so its real
acceptance says nothing about speed. This node replaces the tail's draft decision
(`cluster.decode.tail.decide`) by an oracle that accepts each draft with probability `--accept-rate`
and otherwise emits the target's correction. Everything else is the real per-token path: the
MTP head still drafts, every node still computes `[y, d]`, snapshots its GatedDeltaNet state
and, on a rejection, restores it and trims its KV cache. Only the tail's decision is patched;
nodes that are not the tail behave exactly like `cluster node`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from collections.abc import Callable

import mlx.core as mx

import cluster.decode.tail
from cluster.decode.verify import Candidates

Decide = Callable[[Candidates, tuple[int, ...]], tuple[tuple[int, ...], int]]


def oracle_decide(accept_rate: float, seed: int = 0) -> Decide:
    """`cluster.decode.verify.decide` with the draft's fate drawn at `accept_rate` instead of read
    from the target distribution. The emitted tokens come from the same evaluated candidates
    (accepted drafts, then the target's bonus token or the correction)."""
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"accept rate must be in [0, 1], got {accept_rate}")
    rng = random.Random(seed)

    def decide(candidates: Candidates, drafts: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        target = candidates.target.tolist()
        if not drafts:
            return (target[0],), 0
        correction = target if candidates.correction is None else candidates.correction.tolist()
        for i in range(len(drafts)):
            if rng.random() >= accept_rate:
                return (*drafts[:i], correction[i]), i
        return (*drafts, target[len(drafts)]), len(drafts)

    return decide


def install_oracle(accept_rate: float, seed: int = 0) -> Decide:
    """Patch the tail of this process; returns the decision it replaced."""
    previous = cluster.decode.tail.decide
    cluster.decode.tail.decide = oracle_decide(accept_rate, seed)
    return previous


def restore_decide(previous: Decide) -> None:
    cluster.decode.tail.decide = previous


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.bench.oracle_node", description=__doc__
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--accept-rate", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--node-id", default=None)
    parser.add_argument(
        "--cache-limit-gb", type=float, default=None, help="cap MLX's buffer cache (GiB)"
    )
    args = parser.parse_args(argv)
    if args.cache_limit_gb is not None:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    install_oracle(args.accept_rate, args.seed)
    from node.server import serve

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, args.token, node_id=args.node_id, advertise=False))


if __name__ == "__main__":
    main()
