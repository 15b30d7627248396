"""Would speculation in flight beat today's MTP pipeline for one request? A model, not a run.

    python -m benchmarks.inflight_model

N stages; a stage over a step of w positions takes `cost(w)` stage-times: flat up to about 9
positions on bandwidth-bound Macs (a step reads the weights once), and on the H200 at the 27B
shape the rounds measured by `mtp_depth_bench` (1.53x, 1.76x, 1.82x for 2-4 positions; beyond,
+0.05 a position). A hop costs HOP of a stage, and each draft the MTP head makes MTP_DRAFT.
Each draft is accepted with probability a.

- Today, depth k: a round of N stages over k + 1 positions gives (1 - a^(k+1)) / (1 - a)
  tokens (the accepted drafts and the bonus or correction).
- In flight: after a rejection the tail drafts ahead and the driver sends a step of k + 1
  positions, then, one stage behind each other, steps of k more drafts on the assumption
  that every draft before them is accepted. A run ends at the first rejection, which drains
  the pipeline: 1 / (1 - a) tokens, after the first step's round plus one stage per step
  that passed whole (a^k / (1 - a^k) of them).

Printed: per stage count and cost, the best in-flight depth over today's best depth.
"""

from __future__ import annotations

from collections.abc import Callable

HOP = 0.3 / 17.5  # 0.3 ms over Thunderbolt TCP, against a 27B stage's 17.5 ms on a Mac
MTP_DRAFT = 0.065  # the MTP head's pass, of a 27B step
H200_ROUNDS = {1: 1.0, 2: 1.53, 3: 1.76, 4: 1.82}
DEPTHS = range(1, 9)
RATES = (0.5, 0.7, 0.9)


def flat(width: int) -> float:
    return 1.0


def h200(width: int) -> float:
    return H200_ROUNDS.get(width, H200_ROUNDS[4] + 0.05 * (width - 4))


def today(a: float, k: int, stages: int, cost: Callable[[int], float]) -> float:
    """Tokens per stage-time at depth k."""
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens / (stages * (cost(k + 1) + HOP) + k * MTP_DRAFT)


def in_flight(a: float, k: int, stages: int, cost: Callable[[int], float]) -> float:
    """Tokens per stage-time with steps of k drafts in flight."""
    first = stages * (cost(k + 1) + HOP) + k * MTP_DRAFT
    passes = a**k / (1 - a**k)
    return (1 / (1 - a)) / (first + passes * (cost(k) + k * MTP_DRAFT))


def main() -> None:
    for name, cost in (("Macs (flat)", flat), ("H200 rounds", h200)):
        for stages in (2, 4):
            cells = []
            for a in RATES:
                best_today = max(today(a, k, stages, cost) for k in (0, *DEPTHS))
                best_ahead = max(in_flight(a, k, stages, cost) for k in DEPTHS)
                cells.append(f"a={a}: {best_ahead / best_today:.2f}x")
            print(f"{name}, {stages} stages: in flight over today: " + ", ".join(cells))


if __name__ == "__main__":
    main()
