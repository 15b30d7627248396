"""How many MTP drafts a request's next step carries: fixed, or chosen where drafting pays.

Each request keeps its running acceptance at each draft position: `rate[i]` is the chance
that draft i+1 passes given that the drafts before it passed (a draft after a rejection is
never judged, so it is not counted). With k drafts a step emits on average
    E(k) = 1 + r1 + r1 r2 + ... + r1 ... rk
tokens, and takes the round that a batch of its positions takes at the batch's context length,
as the tail timed it (cluster.decode.step_cost.RoundClock: the whole pipeline, hops and host
work included, what the request waits per step). Its drafts also slow the other
requests of the batch, so `auto` picks the k that maximises the batch's tokens per second,
(others + E(k)) / cost(others + 1 + k), counting one token per position of the others (an
upper bound, which leans against drafting). k = 0, a plain step, is one of the candidates:
where extra rows cost per row (a long batch, a CPU) a draft must pass more often than a row
costs, and where no depth beats a plain step `auto` does not draft. Nor does it where, on
enough verdicts, its first draft passes less than one time in five (`MIN_DRAFT_RATE`): what
such drafts could gain is within the noise of the cost readings.

What `auto` cannot see it probes, at a cost bounded by design. A depth it does not draft at
has no verdicts, and a depth it does not step at has no cost at the request's context; and
the tail records only rounds between steps that keep their depth (the step where a depth
changes costs neither depth's price), so a probe is a short run of steps:
- every `PROBE_EVERY` steps, a request that does not draft drafts one draft for
  `PROBE_STEPS` steps (the acceptance, and the cost of a step with a draft); every
  `CLOSE_PROBE_EVERY` steps while its estimate rests on few verdicts (`FEW_VERDICTS`) and one
  draft is expected to pay nearly as well as none (`CLOSE`): a few early rejections, which a
  text's first tokens often bring, would otherwise keep a request plain for the rest of a
  typical answer;
- one that drafts alternates between `PROBE_STEPS` steps one draft deeper (the acceptance
  there, the cost of one more row) and `PLAIN_PROBE_STEPS` plain steps (the cost of a step
  without drafts at this context);
- a probe whose drafts all passed goes on one step more (the text may have turned
  predictable). At an acceptance of 0 that never happens: where drafts fail, `auto` drafts
  on `PROBE_STEPS` steps in `PROBE_EVERY`, 2 %.
- before the node has timed a plain step, a request steps plainly (which times it); the
  first count of positions above its choice that the node cannot cost at all is probed once.

A request's estimates start from the node's running acceptance over all its requests (an
optimistic constant before any verdict). Verdicts fade by `DECAY` each: the estimate follows
the request's text within a few tens of steps (see `DECAY`).

A request leaves its depth only for one expected to be `SWITCH_MARGIN` faster. Where depths
are close (on a GPU at an acceptance near 0.5 every depth is within a few percent of the
others) the estimates' noise would otherwise flip the depth every few steps, and a change is
not free: the step after it cannot be built ahead, and a depth not drafted at for a while
has no fresh cost at the request's context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.decode.step_cost import StepCost
from cluster.messages import MtpDepth, SamplingParams

AUTO_MAX_DEPTH = 4  # what `auto` explores; fixed depths may go to MAX_MTP_DEPTH
PRIOR_RATE, PRIOR_WEIGHT = 0.7, 2.0  # as if two drafts of each position were judged
# Older verdicts fade: a request's text changes as it goes. At 0.9 the estimate weighs about
# the last ten verdicts: after a long run of passes and then none, the rate at the first
# position falls as 0.9^n, under 0.5 (where a CPU's second row stops paying) after 7 verdicts
# and under 0.2 (a device where a second row costs a quarter of a step) after 16, with the
# prior and a verdict read one step late (a step built ahead) adding a few steps: well within
# 32 tokens.
DECAY = 0.9
# A probe every 100 steps: 2 steps drafting where drafts fail, 2 % of the steps.
PROBE_EVERY = 100
# Where a draft's expected tokens per second are within this share of a plain step's and
# the request's estimate rests on less than FEW_VERDICTS (decayed) verdicts, it may well be
# wrong the other way: a plain request then probes every CLOSE_PROBE_EVERY steps, 2 drafting
# steps in 16 that cost at most 15 % each. Each probe adds 2 verdicts, so a request whose
# drafts do fail is soon sure of it and probes every PROBE_EVERY steps again.
CLOSE, CLOSE_PROBE_EVERY, FEW_VERDICTS = 0.85, 16, 6.0
PROBE_STEPS = 2  # the first drafts after plain steps, the second is one the node records
WARM_UP_STEPS = 4  # the first probe of a count: three steps recorded, not one sample
# Once `auto` stops drafting it stays plain this many steps at least: a run of plain steps is
# what the node records as a plain step's cost (a lone one between drafting steps is not).
HOLD_PLAIN = 4
PLAIN_PROBE_STEPS = 3  # the first carries the last verdict, the last feeds the MTP head
# A row more is never taken to cost less than this share of what a row of the batch costs on
# average (of the whole step, for a request alone): each position is read, written and
# attended to, so a reading below it is the noise of a busy machine. The floor also keeps an
# acceptance near 0 (whose estimate never quite reaches 0 under the prior) from drafting on
# costs that read as equal.
MIN_ROW_COST = 0.05
# A depth is left for another only when that one is expected to be this much faster: what
# `auto` may lose against the best fixed depth by staying, and far less than a change costs
# when the estimates' noise flips it.
SWITCH_MARGIN = 0.03
# Once its estimate rests on FEW_VERDICTS, a request whose first draft is expected to pass
# less often than this does not draft on the estimates (probes still judge it). Such drafts
# gain at most 1.2 / 1.05 where rows are nearly free (a Mac) and nothing where a row costs a
# quarter of a step or more (a GPU host, a CPU), less than the readings of a busy machine
# move: a plain round timed in a slow moment against drafting rounds timed since can read a
# second row at the MIN_ROW_COST floor, where a near-zero acceptance looks worth drafting, and
# SWITCH_MARGIN then keeps the request drafting for nothing until its next plain probe. (The
# prior keeps a request's estimate at a sixth of the node's at least, under 0.2 for any node.)
MIN_DRAFT_RATE = 0.2


# The depth of a request that asks for reproducible samples (a seed) where `auto` is only the
# server's default: one draft, as before `auto` was the default.
REPRODUCIBLE_DEPTH = 1


def served_depth(default: MtpDepth, sampling: SamplingParams) -> MtpDepth:
    """The depth a request that names none is served at: the server's `default`, except that
    a default of `auto` serves a seeded sampled request at REPRODUCIBLE_DEPTH.

    A seed asks for the same tokens every time. Greedy tokens never depend on the drafts, but
    sampled ones do: the acceptance rule keeps the output's distribution, not each token, and
    `auto` picks the depth from the machine's timings and the batch it runs in. At a fixed
    depth a seeded request's tokens are the same on every run, and after a replay on new
    nodes. A request that names `auto` itself gets it."""
    if default == "auto" and not sampling.greedy and sampling.seed is not None:
        return REPRODUCIBLE_DEPTH
    return default


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
        what this acceptance saw weighed against `prior`'s estimate (or, without a prior,
        PRIOR_RATE at the first position and the estimate of the position before at the
        others: a position never judged is not taken to pass more often than the one before
        it, which would make a deep step look worth it where the first draft fails)."""
        judged = self.judged[position] if position < len(self.judged) else 0.0
        passed = self.passed[position] if position < len(self.passed) else 0.0
        if prior is not None:
            start = prior.rate(position)
        elif position == 0:
            start = PRIOR_RATE
        else:
            start = min(PRIOR_RATE, self.rate(position - 1))
        return (passed + start * PRIOR_WEIGHT) / (judged + PRIOR_WEIGHT)

    def verdicts(self) -> float:
        """How many verdicts on a first draft the estimate rests on (decayed)."""
        return self.judged[0] if self.judged else 0.0

    def expected_tokens(self, depth: int, prior: Acceptance | None = None) -> float:
        total, reach = 1.0, 1.0
        for i in range(depth):
            reach *= self.rate(i, prior)
            total += reach
        return total


def depth_rates(
    acceptance: Acceptance,
    cost: StepCost,
    others: int,
    max_depth: int = AUTO_MAX_DEPTH,
    prior: Acceptance | None = None,
    context: int = 0,
) -> dict[int, float]:
    """Expected tokens per second of a batch where `others` positions belong to other
    requests, at `context` positions (the batch's longest), for each depth whose cost the node
    can tell; empty while it cannot tell a plain step's, and the plain step's alone where the
    first draft is expected to pass less often than MIN_DRAFT_RATE."""
    plain = cost.seconds(others + 1, context)
    if plain is None:
        return {}
    rates = {0: (others + 1) / max(plain, 1e-9)}
    if acceptance.verdicts() >= FEW_VERDICTS and acceptance.rate(0, prior) < MIN_DRAFT_RATE:
        return rates
    floor = plain
    row_floor = plain * MIN_ROW_COST / (others + 1)  # of what a row of this batch costs
    for depth in range(1, max_depth + 1):
        seconds = cost.seconds(others + 1 + depth, context)
        if seconds is None:
            break  # a count never timed anywhere: a probe times it
        # More positions always cost more (what says otherwise is noise).
        seconds = floor = max(seconds, floor + row_floor)
        rates[depth] = (others + acceptance.expected_tokens(depth, prior)) / max(seconds, 1e-9)
    return rates


def choose_depth(rates: dict[int, float], others: int, current: int | None = None) -> int:
    """The depth of `depth_rates` with the most tokens per second (0 where none is known). With
    `current`, the request's depth now, that depth is kept unless the best is expected to be
    `SWITCH_MARGIN` faster (of the request's share of the batch)."""
    if not rates:
        return 0
    best = max(rates, key=lambda depth: (rates[depth], -depth))  # the shallower on a tie
    if current in rates:
        # The margin is of this request's share of the batch: in a batch of many positions
        # one request's depth moves the batch's rate by about its share, not by 3 %.
        share = (1 + current) / (others + 1 + current)
        if rates[best] <= rates[current] * (1 + SWITCH_MARGIN * share):
            return current
    return best


@dataclass(slots=True)
class DepthPolicy:
    """One request's draft count for each next step. `steps` counts its decisions,
    `drafting` those with drafts, `probes` those that were probes."""

    mode: MtpDepth
    node: Acceptance | None = None  # the node's, over all requests (shared, updated here too)
    acceptance: Acceptance = field(default_factory=Acceptance)
    steps: int = 0
    drafting: int = 0
    probes: int = 0
    _probe_depth: int = 0
    _probe_left: int = 0  # steps of the probe under way still to take
    _probing: bool = False  # a probe with drafts is under way: its verdicts may extend it
    _plain_next: bool = False  # the next periodic probe of a drafting request: plain steps
    _warmed: bool = False  # the count the node could not cost was probed once
    _hold: int = 0  # plain steps still to take before drafting again (`HOLD_PLAIN`)
    _chosen: int | None = None  # the last depth chosen on the estimates (not a probe's)
    _since_probe: int = 0  # decisions since the last periodic probe began

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance.record(drafted, accepted)
            if self.node is not None:
                self.node.record(drafted, accepted)
            if self._probing and accepted == drafted and self._probe_left == 0:
                self._probe_left = 1  # every draft passed: one step more

    def next_depth(self, cost: StepCost, others: int, context: int = 0) -> int:
        if self.mode != "auto":
            return self.mode
        self.steps += 1
        self._since_probe += 1
        rates = depth_rates(self.acceptance, cost, others, prior=self.node, context=context)
        depth = self._chosen = choose_depth(rates, others, self._chosen)
        if self._hold:
            self._hold -= 1
            depth = 0
        elif depth == 0 and self._probe_left == 0:
            self._hold = HOLD_PLAIN - 1
        if self._probe_left == 0:
            self._probing = False
            close = (
                depth == 0
                and self.acceptance.verdicts() < FEW_VERDICTS
                and rates.get(1, 0.0) >= CLOSE * rates.get(0, float("inf"))
            )
            self._start_probe(depth, cost, others, context, close)
        if self._probe_left:
            self._probe_left -= 1
            self.probes += 1
            depth = self._probe_depth
        if depth:
            self.drafting += 1
        return depth

    def _start_probe(
        self, best: int, cost: StepCost, others: int, context: int, close: bool
    ) -> None:
        """`close`: a plain request whose first draft is expected to pay nearly as well."""
        deeper = min(best + 1, AUTO_MAX_DEPTH)
        if not self._warmed and deeper > best:
            known = cost.seconds(others + 1 + best, context) is not None
            if known and cost.seconds(others + 1 + deeper, context) is None:
                self._warmed = True  # a count never timed anywhere, next to the choice
                self._probe(deeper, WARM_UP_STEPS)
                return
        if self._since_probe < (CLOSE_PROBE_EVERY if close else PROBE_EVERY):
            return
        self._since_probe = 0
        if best > 0:
            self._plain_next = not self._plain_next
            if self._plain_next or deeper == best:
                self._probe(0, PLAIN_PROBE_STEPS)
                return
        self._probe(deeper, PROBE_STEPS)

    def _probe(self, depth: int, steps: int) -> None:
        self._probe_depth, self._probe_left, self._probing = depth, steps, depth > 0
