"""A node daemon whose tail accepts each MTP draft with a fixed probability (benchmarks only).

    python -m benchmarks.oracle_node --host 127.0.0.1 --port P --token T --accept-rate 0.7

A model with random weights drafts tokens its backbone almost never agrees with, so its real
acceptance says nothing about speed. This node replaces whether each draft passes (the
`accept` of the tail's candidates, `cluster.decode.tail.propose`) by a draw at `--accept-rate`;
a rejected draft is followed by the target's correction. The draw is made where the real test
is, on the device's side of the step: the verdict the device reads (the runner's steps built
ahead) and the one the host reads agree, as they do for real drafts. Everything else is the
real per-token path: the MTP head still drafts, every node still computes `[y, d]`, snapshots
its GatedDeltaNet state and, on a rejection, restores it and trims its KV cache. Only the
tail's test of the drafts is patched; nodes that are not the tail behave exactly like
`cluster node`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from collections.abc import Callable

import mlx.core as mx

import cluster.decode.tail
from cluster.decode.late_input import BUILD_AHEAD_SETTINGS
from cluster.decode.verify import Candidates

Propose = Callable[..., Candidates]


def oracle_propose(accept_rate: float, seed: int = 0, propose: Propose | None = None) -> Propose:
    """`cluster.decode.verify.propose` with each draft's fate drawn at `accept_rate` instead of
    tested against the target distribution. The tokens come from the real candidates (the
    target's own token at each position: the correction of a rejected draft, or the bonus)."""
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"accept rate must be in [0, 1], got {accept_rate}")
    rng = random.Random(seed)
    propose = propose or cluster.decode.tail.propose

    def oracle(target_logprobs, drafts, draft_logprobs, params, request_rng) -> Candidates:
        candidates = propose(target_logprobs, drafts, draft_logprobs, params, request_rng)
        if len(drafts) == 0:
            return candidates
        accept = mx.array([rng.random() < accept_rate for _ in range(len(drafts))])
        return Candidates(candidates.target, accept, candidates.correction)

    return oracle


def install_oracle(accept_rate: float, seed: int = 0) -> Propose:
    """Patch the tail of this process; returns what it replaced (for `remove_oracle`)."""
    previous = cluster.decode.tail.propose
    cluster.decode.tail.propose = oracle_propose(accept_rate, seed, previous)
    return previous


def remove_oracle(previous: Propose) -> None:
    cluster.decode.tail.propose = previous


def add_node_options(parser: argparse.ArgumentParser) -> None:
    """The `cluster node` settings this node takes too (a benchmark's node sets vary them)."""
    parser.add_argument("--spin-ms", type=float, default=None, help="as `cluster node --spin-ms`")
    parser.add_argument(
        "--build-ahead",
        choices=BUILD_AHEAD_SETTINGS,
        default="auto",
        help="as `cluster node --build-ahead`",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.oracle_node", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--accept-rate", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--node-id", default=None)
    parser.add_argument(
        "--cache-limit-gb", type=float, default=None, help="cap MLX's buffer cache (GiB)"
    )
    parser.add_argument(
        "--memory-share", type=float, default=1.0, help="as `cluster node --memory-share`"
    )
    add_node_options(parser)
    args = parser.parse_args(argv)
    if args.spin_ms is not None and args.spin_ms < 0:
        parser.error("--spin-ms must be >= 0")
    if not 0 < args.memory_share <= 1:
        parser.error("--memory-share must be in (0, 1]")
    if args.cache_limit_gb is not None:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    install_oracle(args.accept_rate, args.seed)
    from node.server import NodeSettings, serve

    with contextlib.suppress(KeyboardInterrupt):
        spin_s = args.spin_ms / 1e3 if args.spin_ms is not None else None
        settings = NodeSettings(
            args.token,
            host=args.host,
            port=args.port,
            node_id=args.node_id,
            spin_s=spin_s,
            build_ahead=args.build_ahead,
            memory_share=args.memory_share,
        )
        asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
