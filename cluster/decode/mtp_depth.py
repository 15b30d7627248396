"""How many MTP drafts a request's next step carries: fixed, or chosen where drafting pays.

Each request keeps its running acceptance at each draft position: `rate[i]` is the chance
that draft i+1 passes given that the drafts before it passed (a draft after a rejection is
never judged, so it is not counted). With k drafts a step emits on average
    E(k) = 1 + r1 + r1 r2 + ... + r1 ... rk
tokens, and costs what a batch of its positions costs on this node (cluster.decode.step_cost,
the node's own counters). Its drafts also slow the other requests of the batch, so `auto` picks
the k that maximises the batch's tokens per second, (others + E(k)) / cost(others + 1 + k),
counting one token per position of the others (an upper bound, which leans against drafting).
k = 0 when no depth beats a plain step: where extra rows cost per row (a long batch, a CPU)
a draft must pass more often than a row costs. Across a pipeline the tail reads its own
node's curve as every stage's (placement balances the stages); the hops cost the same at any
depth, so leaving them out only leans the choice toward fewer drafts.

A request's estimates start from the node's running acceptance over all its requests (an
optimistic constant before any verdict), and a depth that is not chosen is still tried every
`EXPLORE_EVERY` steps (one deeper than the choice), so that a request whose text turns
predictable, or a machine that turns out cheap per row, is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.decode.step_cost import StepCost
from cluster.messages import MtpDepth

AUTO_MAX_DEPTH = 4  # what `auto` explores; fixed depths may go to MAX_MTP_DEPTH
PRIOR_RATE, PRIOR_WEIGHT = 0.7, 2.0  # as if two drafts of each position were judged
DECAY = 0.95  # older verdicts fade: a request's text changes as it goes
EXPLORE_EVERY = 16  # steps


@dataclass(slots=True)
class Acceptance:
    """Running acceptance at each draft position (conditional on the earlier ones passing)."""

    judged: list[float] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        """One verdict: `accepted` of `drafted` drafts passed before the first rejection."""
        while len(self.judged) < drafted:
            self.judged.append(0.0)
            self.passed.append(0.0)
        for i in range(min(accepted + 1, drafted)):  # positions after a rejection: unjudged
            self.judged[i] = self.judged[i] * DECAY + 1.0
            self.passed[i] = self.passed[i] * DECAY + (1.0 if i < accepted else 0.0)

    def rate(self, position: int, prior: Acceptance | None = None) -> float:
        """Estimated chance that draft `position` (0-based) passes after the earlier ones,
        what this acceptance saw weighed against `prior`'s estimate (or PRIOR_RATE)."""
        judged = self.judged[position] if position < len(self.judged) else 0.0
        passed = self.passed[position] if position < len(self.passed) else 0.0
        start = prior.rate(position) if prior is not None else PRIOR_RATE
        return (passed + start * PRIOR_WEIGHT) / (judged + PRIOR_WEIGHT)

    def expected_tokens(self, depth: int, prior: Acceptance | None = None) -> float:
        total, reach = 1.0, 1.0
        for i in range(depth):
            reach *= self.rate(i, prior)
            total += reach
        return total


def best_depth(
    acceptance: Acceptance,
    cost: StepCost,
    others: int,
    max_depth: int = AUTO_MAX_DEPTH,
    prior: Acceptance | None = None,
) -> int:
    """The depth with the most expected tokens per second for a batch where `others`
    positions belong to other requests; 1 while the node has measured nothing."""
    if cost.seconds(others + 1) is None:
        return min(1, max_depth)
    best, best_rate = 0, 0.0
    for depth in range(max_depth + 1):
        seconds = cost.seconds(others + 1 + depth)
        rate = (others + acceptance.expected_tokens(depth, prior)) / max(seconds, 1e-9)
        if rate > best_rate:
            best, best_rate = depth, rate
    return best


@dataclass(slots=True)
class DepthPolicy:
    """One request's draft count for each next step."""

    mode: MtpDepth
    node: Acceptance | None = None  # the node's, over all requests (shared, updated here too)
    acceptance: Acceptance = field(default_factory=Acceptance)
    steps: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance.record(drafted, accepted)
            if self.node is not None:
                self.node.record(drafted, accepted)

    def next_depth(self, cost: StepCost, others: int) -> int:
        if self.mode != "auto":
            return self.mode
        self.steps += 1
        depth = best_depth(self.acceptance, cost, others, prior=self.node)
        if self.steps % EXPLORE_EVERY == 0:
            depth = min(depth + 1, AUTO_MAX_DEPTH)
        return depth
