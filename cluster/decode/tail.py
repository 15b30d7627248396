"""The tail's work after its layers: tokens out, drafts verified, the next draft made.

Only the tail turns hidden states into tokens. For each request of a step it
1. computes logits at the last confirmed position and at each draft (one lm_head matmul for
   the whole batch),
2. samples or verifies (cluster.decode.verify), which fixes how many of the step's positions stay,
3. feeds the MTP head the newly confirmed (hidden state, next token) pairs and drafts the
   token after the last emitted one.

All of it is one lazy graph and one device sync for the whole batch. Step 3 cannot wait for
the verdict of step 2 without a second sync, so for a step [y, d] the MTP head is fed both
pairs it may need, (h_y, d-or-correction) and (h_d, bonus), with the token chosen on the
device; the draft comes from the position the verdict picks, also on the device (one lm_head
row); once the verdict is read, a rejection trims the second pair from the MTP cache.

Deeper drafts (the request's `mtp_depth`, fixed or chosen by cluster.decode.mtp_depth) chain
the MTP head on its own output: (o_t, d1) -> d2, (o_{t+1}, d2) -> d3, ... after the verdict,
for every request of the batch at once, with one more sync. Each link writes an entry to the
MTP cache that no verdict will confirm; those `speculative` entries are discarded before the
next step feeds its confirmed pairs, so the MTP cache only ever holds confirmed pairs.

Where `auto` chose not to draft from a step without drafts, the MTP head is not run: the
step's pairs wait on the request (`TailRequest.unfed`) and go in with the pairs of the next
step that drafts, in one pass (or before a prefix snapshot reads the MTP cache, `feed_unfed`).
A request that does not draft then costs what it costs without MTP; the MTP cache ends up
with the same pairs.

A step built ahead (cluster.decode.runner) is launched before the verdict of the step before
it is read: its tokens are still on the device (`TailJob.inputs`, from `next_input`), and its
MTP cache holds that verdict deferred (cluster.model.cache): the runner resolves it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from cluster.decode.mtp_depth import Acceptance, DepthPolicy
from cluster.decode.sampling import DRAFT, RequestRandom, log_probs, sample_with
from cluster.decode.step_cost import StepCost, batch_context
from cluster.decode.token_mask import constrain
from cluster.decode.verify import Candidates, decide, propose
from cluster.messages import (
    MAX_MTP_DEPTH,
    RequestError,
    RequestOptions,
    SamplingParams,
    StepRequest,
    StepResult,
)
from cluster.model.cache import CacheMark, RequestCache
from cluster.model.layers import Segment
from cluster.model.shard import ModelShard

_PLAIN = SamplingParams()  # greedy params: log_probs gives the model's own distribution

# A verdict override for tests and benchmarks: given a step with drafts, how many of them to
# accept (None: the model's verdict). The step then emits the accepted drafts and the model's
# token after them; where it accepts a draft the model rejected, the output is no longer the
# model's (that is the point: a fixed acceptance on any model).
ForcedVerdict = Callable[[StepRequest], int | None]


def _ids(tokens: tuple[int, ...]) -> mx.array:
    return mx.array(tokens, dtype=mx.uint32)


@dataclass(frozen=True, slots=True)
class TailRequestMark:
    """A `TailRequest` at one moment (`TailRequest.mark`)."""

    mtp_cache: CacheMark | None
    pending_hidden: mx.array | None
    recent_inputs: mx.array | None
    unfed: tuple[tuple[mx.array, mx.array], ...] = ()

    def trimmed(self, drop: int) -> TailRequestMark:
        """This mark less the last `drop` MTP pairs (those after a rejected draft)."""
        if self.mtp_cache is None or drop == 0:
            return self
        return dataclasses.replace(self, mtp_cache=self.mtp_cache.trimmed(drop))


@dataclass(slots=True)
class TailRequest:
    """What the tail keeps for one request between steps."""

    options: RequestOptions
    rng: RequestRandom
    mtp_cache: RequestCache | None
    # The MTP input of the last confirmed position whose next token is not known yet
    # (the end of a prefill chunk that is not the prompt's last).
    pending_hidden: mx.array | None = None
    drafts: tuple[int, ...] = ()
    draft_logprobs: mx.array | None = None  # [k, vocab]: the distributions `drafts` came from
    speculative: int = 0  # MTP cache entries that chained drafts wrote (never confirmed)
    depth: DepthPolicy | None = None
    # The MTP inputs of the last sampled step from its last confirmed position on (where its
    # kept positions may end), from position `recent_start`: a prefix snapshot's pending pair.
    recent_inputs: mx.array | None = None
    recent_start: int = 0
    # The (hidden states [1, n, hidden], tokens [n]) pairs of the steps since the MTP head
    # last ran, oldest first: `auto` chose no draft after them (the module's docstring).
    unfed: tuple[tuple[mx.array, mx.array], ...] = ()

    @property
    def nbytes(self) -> int:
        return self.mtp_cache.nbytes if self.mtp_cache else 0

    def mark(self) -> TailRequestMark:
        """What a launch changes here; `restore` undoes a step launched since."""
        cache = self.mtp_cache.mark() if self.mtp_cache is not None else None
        return TailRequestMark(cache, self.pending_hidden, self.recent_inputs, self.unfed)

    def restore(self, mark: TailRequestMark) -> None:
        if self.mtp_cache is not None:
            self.mtp_cache.restore(mark.mtp_cache)
        self.pending_hidden, self.recent_inputs = mark.pending_hidden, mark.recent_inputs
        self.unfed = mark.unfed

    def discard_speculative(self) -> None:
        """Drop what chained drafts wrote to the MTP cache: it then holds confirmed pairs only."""
        if self.speculative:
            self.mtp_cache.discard(self.speculative)
            self.speculative = 0


@dataclass(frozen=True, slots=True)
class NextInput:
    """The step after a job's, known on the device before its verdict is read: its tokens
    (the last token the job emits, then the drafts it made), how many of them are drafts,
    and the job's own drafts, of which the verdict (`accepted`) keeps some."""

    tokens: mx.array
    drafts: int
    undecided: int
    accepted: mx.array | None


@dataclass(slots=True)
class TailJob:
    """One request's share of a step at the tail, as it is built up."""

    step: StepRequest
    state: TailRequest
    offset: int  # of the step's first position in the packed batch
    candidates: Candidates | None = None  # None: an intermediate prefill chunk
    logprobs: mx.array | None = None  # the model's own, at the rows where tokens are due
    top: tuple[mx.array, mx.array] | None = None  # the likeliest tokens per row, their logprobs
    mtp_tokens: mx.array | None = None  # the tokens paired with `mtp_hidden`
    mtp_hidden: mx.array | None = None  # [1, pairs, hidden]
    draft: tuple[mx.array, mx.array] | None = None  # the next draft and its distribution
    draft_hidden: mx.array | None = None  # [hidden]: the MTP output the next draft came from
    depth: int = 0  # drafts to hand back for the next step
    decided: bool = False  # the depth policy chose `depth` in this step (`Tail.depth_steps`)
    emitted: tuple[int, ...] = ()
    keep: int = 0
    accepted: int = 0
    emitted_logprobs: tuple[float, ...] | None = None
    emitted_top: tuple[tuple[tuple[int, float], ...], ...] | None = None
    inputs: mx.array | None = None  # the step's tokens, when they were on the device at launch
    verdict: mx.array | None = None  # [] the drafts accepted, on the device

    def tokens(self, begin: int, end: int | None = None) -> mx.array:
        """The step's tokens [begin:end] on the device."""
        if self.inputs is not None:
            return self.inputs[begin:end]
        return _ids(self.step.tokens[begin:end])

    @property
    def replays(self) -> bool:
        """A replay's prefill chunk whose next token is known: it drafts, samples nothing."""
        return self.candidates is None and self.step.next_token is not None

    @property
    def drafts(self) -> bool:
        """Whether the MTP head may make a draft for this request in this step."""
        return (self.candidates is not None or self.replays) and self.depth > 0

    def first_draft_position(self) -> int:
        """The position of the first draft, once the verdict is read."""
        return self.step.position + self.step.n_confirmed + self.accepted + 1

    def arrays(self) -> list[mx.array]:
        out = self.candidates.arrays() if self.candidates else []
        out += [self.verdict] if self.verdict is not None else []
        out += [self.logprobs] if self.logprobs is not None else []
        out += list(self.top or ())
        return out + list(self.draft or ())


class Tail:
    def __init__(
        self,
        shard: ModelShard,
        *,
        mtp_reads_prenorm: bool = False,
        round_cost: StepCost | None = None,
        force_verdict: ForcedVerdict | None = None,
    ):
        self.shard = shard
        self.mtp_reads_prenorm = mtp_reads_prenorm
        # What a request's round costs by the batch's positions and context (the runner's
        # `RoundClock`): what `auto` weighs drafts against.
        self.round_cost = round_cost if round_cost is not None else StepCost()
        self.acceptance = Acceptance()  # over all requests: a new request's starting point
        # For tests and benchmarks only: each drafted step's verdict (`ForcedVerdict`).
        self.force_verdict = force_verdict
        # The depth chosen for each next step of an MTP request (fixed, or `auto`'s choice),
        # cumulative, counted when the step that chose it concludes (a step built ahead and
        # undone chose nothing): steps decided, those at depth 0, the drafts chosen over them.
        # The node reports them (NodeInfo.mtp_*); `cluster bench` takes their differences.
        self.depth_steps = 0
        self.depth_plain_steps = 0
        self.depth_drafts = 0

    def open(self, options: RequestOptions | None) -> TailRequest:
        options = options or RequestOptions()
        use_mtp = options.mtp and self.shard.has_mtp
        mtp_cache = (
            RequestCache.for_layers([False] * len(self.shard.mtp.layers)) if use_mtp else None
        )
        depth = DepthPolicy(options.mtp_depth, self.acceptance) if use_mtp else None
        return TailRequest(options, RequestRandom(options.sampling.seed), mtp_cache, depth=depth)

    @staticmethod
    def check_drafts(state: TailRequest, step: StepRequest) -> None:
        """A sampled request's drafts must be (a prefix of) the tail's own: their verification
        needs the distributions they were drawn from. Greedy verification is an exact match
        against the target, so any drafts verify exactly (the engine may shorten or replace
        them)."""
        drafts = step.tokens[step.n_confirmed :]
        if len(drafts) > MAX_MTP_DEPTH:
            raise RequestError(f"a step carries at most {MAX_MTP_DEPTH} drafts, got {len(drafts)}")
        if state.options.sampling.greedy or not drafts:
            return
        if drafts != state.drafts[: len(drafts)]:
            raise RequestError(f"request {step.request_id!r}: the drafts are not the tail's")

    def launch(
        self,
        steps: list[StepRequest],
        states: list[TailRequest],
        hidden: mx.array,
        inputs: list[mx.array] | None = None,
        *,
        start: bool = True,
    ) -> list[TailJob]:
        """Build the step's tail work lazily (tokens, verdicts, the next drafts) and, unless
        not to `start` (its input is not there yet), start the device on it; `conclude` reads
        it. Between the two, the caller may build more work on the lazy tokens
        (`next_input`): the runner's step built ahead, whose tokens are `inputs` (the `steps`
        hold placeholders until they are read)."""
        normed = self.shard.norm(hidden)
        mtp_input = hidden if self.mtp_reads_prenorm else normed
        offsets = itertools.accumulate((len(s.tokens) for s in steps), initial=0)
        jobs = [TailJob(s, st, o) for s, st, o in zip(steps, states, offsets, strict=False)]
        for job, tokens in zip(jobs, inputs or (), strict=False):
            job.inputs = tokens
        self._verify(jobs, normed)
        mtp_jobs = [j for j in jobs if j.state.mtp_cache is not None]
        # The next step's depth, from the verdicts before this one: known before the sync, a
        # request that will not draft costs no lm_head row for a draft (nor, under `auto`, an
        # MTP head pass).
        positions = sum(len(s.tokens) for s in steps)
        context = batch_context(s.position + len(s.tokens) for s in steps) if mtp_jobs else 0
        for job in mtp_jobs:
            if job.candidates is not None or job.replays:
                others = positions - len(job.step.tokens)
                job.depth = job.state.depth.next_depth(self.round_cost, others, context)
                job.decided = True
            job.state.discard_speculative()
            self._pair(job, mtp_input)
            _hold_or_feed(job)
        self._draft([j for j in mtp_jobs if j.mtp_tokens is not None])
        if start:
            mx.async_eval([a for job in jobs for a in job.arrays()])
        return jobs

    def feed_unfed(self, state: TailRequest) -> None:
        """Run the MTP head over the pairs a request held back (`TailRequest.unfed`): its
        cache then holds every confirmed pair, as a prefix snapshot reads it."""
        if not state.unfed or state.mtp_cache is None:
            return
        hidden = mx.concatenate([h for h, _ in state.unfed], axis=1)
        tokens = mx.concatenate([t for _, t in state.unfed])
        state.unfed = ()
        state.discard_speculative()
        pairs = tokens.size
        state.mtp_cache.begin_step(0, pairs)
        segment = Segment(state.mtp_cache, pairs, pairs)
        mx.eval(self.shard.mtp(self.shard.embed(tokens[None]), hidden, [segment]))

    def conclude(self, jobs: list[TailJob]) -> list[StepResult]:
        """Wait for the launched work (one sync for the batch), read the verdicts and chain
        deeper drafts: the step's results."""
        mx.eval([a for job in jobs for a in job.arrays()])
        for job in jobs:
            self._conclude(job)
            if job.decided:  # integer adds: this runs per request per step
                self.depth_steps += 1
                self.depth_drafts += job.depth
                self.depth_plain_steps += job.depth == 0
        self._chain([job for job in jobs if job.depth > 1])
        return [self._result(job) for job in jobs]

    @staticmethod
    def next_input(job: TailJob, before_verdict: bool = True) -> NextInput | None:
        """The step after this job's, where the device alone fixes it: a sampled step with no
        mask that its tokens would move, and either no MTP (its token is the next step) or,
        `before_verdict`, greedy MTP at a fixed depth of at most one draft (its last emitted
        token and its draft, picked on the device by the verdict). None elsewhere: a sampled
        request's random numbers are keyed by position, which only the verdict fixes, and
        deeper drafts are chained after it (`conclude`)."""
        step, state, c = job.step, job.state, job.candidates
        if c is None or step.token_masks:
            return None
        if state.mtp_cache is None or (job.depth == 0 and step.draft_len == 0):
            # Nothing drafted, nothing to verify: its token is the next step.
            return NextInput(c.target[-1:], 0, 0, None) if step.draft_len == 0 else None
        greedy = state.options.sampling.greedy
        if not before_verdict or not greedy or job.depth > 1:
            return None
        # Greedy: the last token emitted is the target's at the first rejected draft (its
        # correction), or after the last draft (the bonus).
        last = c.target[-1:] if job.verdict is None else c.target[job.verdict][None]
        if job.depth == 0:
            return NextInput(last, 0, step.draft_len, job.verdict)
        tokens = mx.concatenate([last, job.draft[0][None].astype(last.dtype)])
        return NextInput(tokens, 1, step.draft_len, job.verdict)

    def _verify(self, jobs: list[TailJob], normed: mx.array) -> None:
        """Logits where a token is due (one matmul), then each request's candidates."""
        sampling = [job for job in jobs if job.step.sample]
        rows = []
        for job in sampling:
            first = job.offset + job.step.n_confirmed - 1
            rows.extend(range(first, job.offset + len(job.step.tokens)))
        if not rows:
            return
        logits = self.shard.logits(normed[0, mx.array(rows)])
        spans = list(itertools.pairwise(itertools.accumulate(
            (job.step.draft_len + 1 for job in sampling), initial=0
        )))  # fmt: skip
        targets = _distributions(
            logits,
            [(span, job.state.options.sampling, job.step.token_masks)
             for job, span in zip(sampling, spans, strict=True)],
        )  # fmt: skip
        for job, (start, end), target in zip(sampling, spans, targets, strict=True):
            n = end - start
            drafts = (
                job.step.tokens[job.step.n_confirmed :]
                if job.inputs is None
                else job.tokens(job.step.n_confirmed)
            )
            params = job.state.options.sampling
            q = job.state.draft_logprobs[: n - 1] if n > 1 and not params.greedy else None
            # Keyed by the position of the first token it decides: a replay draws the same.
            rng = job.state.rng.at(job.step.position + job.step.n_confirmed)
            job.candidates = propose(target, drafts, q, params, rng)
            if n > 1:  # the drafts accepted: those before the first rejected one
                job.verdict = mx.cumprod(job.candidates.accept.astype(mx.uint32)).sum()
            if job.state.options.logprobs:
                job.logprobs = log_probs(logits[start:end], _PLAIN)
                job.top = _likeliest(job.logprobs, job.state.options.top_logprobs)

    def _pair(self, job: TailJob, mtp_input: mx.array) -> None:
        """The (hidden state, next token) pairs this step confirms, or may confirm."""
        step, state, c = job.step, job.state, job.candidates
        n = len(step.tokens)
        hidden = mtp_input[:, job.offset : job.offset + n]
        if c is not None:  # (its start is the step's position: set once that is known)
            state.recent_inputs = hidden[:, step.n_confirmed - 1 :]
        if job.replays:  # a replay's last prefill chunk: the token after it is known
            tokens, pending = _ids((*step.tokens[1:], step.next_token)), None
        elif c is None:  # an intermediate prefill chunk: the last position waits for its token
            tokens, pending = job.tokens(1), hidden[:, n - 1 :]
            hidden = hidden[:, : n - 1]
        elif step.draft_len == 0:  # a prompt's last chunk, or a step without a draft
            tokens, pending = mx.concatenate([job.tokens(1), c.target[-1:]]), None
        else:  # [y, d1..dk]: each draft or its correction, then the bonus after dk
            chosen = mx.where(c.accept, job.tokens(step.n_confirmed), c.correction)
            tokens, pending = mx.concatenate([chosen, c.target[-1:]]), None
        if state.pending_hidden is not None:
            hidden = mx.concatenate([state.pending_hidden, hidden], axis=1)
            tokens = mx.concatenate([job.tokens(0, 1), tokens])
        state.pending_hidden = pending
        if tokens.size:
            job.mtp_tokens, job.mtp_hidden = tokens, hidden

    def _draft(self, jobs: list[TailJob]) -> None:
        """Run the MTP head over every request's pairs; draft where a draft may be due."""
        if not jobs:
            return
        segments = []
        for job in jobs:
            pairs = job.mtp_tokens.size
            job.state.mtp_cache.begin_step(0, pairs)
            segments.append(Segment(job.state.mtp_cache, pairs, pairs))
        hidden = mx.concatenate([j.mtp_hidden for j in jobs], axis=1)
        tokens = mx.concatenate([j.mtp_tokens for j in jobs])[None]
        out = self.shard.mtp(self.shard.embed(tokens), hidden, segments)
        ends = list(itertools.accumulate(job.mtp_tokens.size for job in jobs))
        # The draft comes after the position where the last emitted token stands: for a step
        # with k drafts, the one after the accepted prefix, picked on the device. Its random
        # number is keyed by the draft's own position (a replay draws the same), picked on
        # the device the same way.
        rows, uniforms = [], []
        drafting = [job for job in jobs if job.drafts]
        for job, end in zip(jobs, ends, strict=True):
            if not job.drafts:
                continue
            step, rng = job.step, job.state.rng
            first = step.position + len(step.tokens) + 1  # with no draft accepted
            greedy = job.state.options.sampling.greedy
            if step.draft_len:
                k = step.draft_len
                rows.append(out[0, end - k - 1 : end][job.verdict])
                u = None if greedy else rng.uniform_at(range(first - k, first + 1), DRAFT)
                uniforms.append(None if u is None else u[job.verdict])
            else:
                rows.append(out[0, end - 1])
                u = None if greedy else rng.uniform_at(range(first, first + 1), DRAFT)
                uniforms.append(None if u is None else u[0])
        if not rows:
            return
        logits = self.shard.logits(mx.stack(rows))
        setups = [job.state.options.sampling for job in drafting]
        drafts = _sampled_rows(logits, setups, uniforms)
        for job, draft, row in zip(drafting, drafts, rows, strict=True):
            job.draft, job.draft_hidden = draft, row

    def _conclude(self, job: TailJob) -> None:
        """Read the verdict (after the sync): tokens, what stays, the first draft."""
        step, state = job.step, job.state
        if job.candidates is None:
            job.keep = len(step.tokens)
            if job.draft is not None:
                token, q = job.draft
                state.drafts, state.draft_logprobs = (int(token.item()),), q[None]
            return
        forced = None
        if self.force_verdict is not None and step.draft_len:
            forced = self.force_verdict(step)
        job.emitted, job.accepted = decide(job.candidates, step.tokens[step.n_confirmed :], forced)
        job.keep = step.n_confirmed + job.accepted
        state.recent_start = step.position + step.n_confirmed - 1
        if state.mtp_cache is not None:
            rejected = step.draft_len - job.accepted
            # The pairs after the rejected draft never happened. (Where a step built ahead
            # deferred this verdict in the MTP cache, the runner resolves it.)
            if rejected and state.mtp_cache.deferred is None:
                state.mtp_cache.rollback(rejected)
            state.depth.record(step.draft_len, job.accepted)
            state.drafts, state.draft_logprobs = (), None
        if job.draft is not None:
            token, q = job.draft
            state.drafts, state.draft_logprobs = (int(token.item()),), q[None]
        if job.logprobs is not None:  # emitted token j was predicted at row j
            job.emitted_logprobs = tuple(
                job.logprobs[j, t].item() for j, t in enumerate(job.emitted)
            )
        if job.top is not None:
            tokens, values = (a[: len(job.emitted)].tolist() for a in job.top)
            job.emitted_top = tuple(
                tuple(zip(t, v, strict=True)) for t, v in zip(tokens, values, strict=True)
            )

    def _chain(self, jobs: list[TailJob]) -> None:
        """Draft on from each first draft, the MTP head on its own output, all requests of the
        batch at once: link i feeds (o, d_i) at the MTP cache's next position and yields
        d_{i+1}. One sync at the end."""
        if not jobs:
            return
        tokens = {id(job): [job.draft[0]] for job in jobs}
        dists = {id(job): [job.draft[1]] for job in jobs}
        hidden = {id(job): job.draft_hidden for job in jobs}
        for link in range(1, max(job.depth for job in jobs)):
            active = [job for job in jobs if job.depth > link]
            segments = []
            for job in active:
                job.state.mtp_cache.begin_step(0, 1)
                job.state.speculative += 1
                segments.append(Segment(job.state.mtp_cache, 1, 1))
            embedded = self.shard.embed(mx.stack([tokens[id(j)][-1] for j in active])[None])
            inputs = mx.stack([hidden[id(j)] for j in active])[None]
            out = self.shard.mtp(embedded, inputs, segments)
            logits = self.shard.logits(out[0])
            setups = [job.state.options.sampling for job in active]
            # Keyed by the draft's position, which the verdict has fixed by now.
            uniforms = [
                None
                if params.greedy
                else job.state.rng.at(job.first_draft_position() + link, DRAFT).uniform()
                for job, params in zip(active, setups, strict=True)
            ]
            drafts = _sampled_rows(logits, setups, uniforms)
            for i, (job, (token, q)) in enumerate(zip(active, drafts, strict=True)):
                tokens[id(job)].append(token)
                dists[id(job)].append(q)
                hidden[id(job)] = out[0, i]
        for job in jobs:
            job.state.draft_logprobs = mx.stack(dists[id(job)])
        mx.eval([t for ts in tokens.values() for t in ts], [j.state.draft_logprobs for j in jobs])
        for job in jobs:
            job.state.drafts = tuple(int(t.item()) for t in tokens[id(job)])

    @staticmethod
    def _result(job: TailJob) -> StepResult:
        step = job.step
        if job.candidates is None:
            return StepResult(
                step.request_id, (), job.keep, job.state.drafts if job.replays else ()
            )
        return StepResult(
            step.request_id, job.emitted, job.keep, job.state.drafts,
            step.draft_len, job.accepted, job.emitted_logprobs, job.emitted_top,
        )  # fmt: skip


def _hold_or_feed(job: TailJob) -> None:
    """Under `auto`, hold back the pairs of a step without drafts after which no draft is
    due (the MTP head does not run for them); otherwise feed the held ones with the step's."""
    state = job.state
    if job.mtp_tokens is None:
        return
    lazy = state.depth.mode == "auto" and job.depth == 0 and job.step.draft_len == 0
    if lazy and job.candidates is not None:
        state.unfed = (*state.unfed, (job.mtp_hidden, job.mtp_tokens))
        job.mtp_tokens = job.mtp_hidden = None
    elif state.unfed:
        job.mtp_hidden = mx.concatenate([*(h for h, _ in state.unfed), job.mtp_hidden], axis=1)
        job.mtp_tokens = mx.concatenate([*(t for _, t in state.unfed), job.mtp_tokens])
        state.unfed = ()


def _likeliest(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array] | None:
    """The k likeliest tokens of each row, likeliest first, and their logprobs (lazily)."""
    if k == 0:
        return None
    k = min(k, logprobs.shape[-1])
    # A partial sort over the vocabulary, then a full sort of the k only.
    candidates = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, candidates, axis=-1)
    order = mx.argsort(-values, axis=-1)
    tokens = mx.take_along_axis(candidates, order, axis=-1)
    return tokens, mx.take_along_axis(values, order, axis=-1)


def _alike(setups: list[SamplingParams]) -> list[tuple[SamplingParams, list[int]]]:
    """The indices of `setups` grouped by how they sample (seeds aside), in first-seen order:
    requests that sample alike share one transform of their rows (a batch pays the filters'
    ops once per setup, not once per request; the ops are row by row, so a row comes out as
    it would alone)."""
    if len(setups) == 1:
        return [(setups[0], [0])]
    groups: dict[SamplingParams, list[int]] = {}
    for i, params in enumerate(setups):
        groups.setdefault(dataclasses.replace(params, seed=None), []).append(i)
    return list(groups.items())


def _sampled_rows(
    logits: mx.array, setups: list[SamplingParams], uniforms: list[mx.array | None]
) -> list[tuple[mx.array, mx.array]]:
    """A token from each row of `logits` [rows, vocab] and the distribution it was drawn from:
    row i transformed and sampled as `setups[i]` says, with the uniform number `uniforms[i]`
    (None if greedy). Rows that sample alike are transformed and drawn in one call."""
    out: list[tuple[mx.array, mx.array] | None] = [None] * len(setups)
    for params, members in _alike(setups):
        if len(members) == 1:  # alone: its row as it is, no stacking and unstacking
            (i,) = members
            q = log_probs(logits[i], params)
            out[i] = (sample_with(q, params, uniforms[i]), q)
            continue
        q = log_probs(_rows(logits, members), params)
        u = None if params.greedy else mx.stack([uniforms[i] for i in members])
        tokens = sample_with(q, params, u)
        for k, i in enumerate(members):
            out[i] = (tokens[k], q[k])
    return out


def _rows(array: mx.array, rows: list[int]) -> mx.array:
    """`array[rows]`: a slice where the rows are consecutive, else a gather."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return array[rows[0] : rows[0] + len(rows)]
    return array[mx.array(rows)]


def _distributions(
    logits: mx.array, parts: list[tuple[tuple[int, int], SamplingParams, tuple[bytes, ...]]]
) -> list[mx.array]:
    """Each part's log-probabilities: its rows [start, end) of `logits`, transformed as its
    sampling params say after its token masks. Unmasked parts that sample alike are
    transformed together (`_alike`)."""
    out: list[mx.array | None] = [None] * len(parts)
    free = [i for i, (_, _, masks) in enumerate(parts) if not masks]
    for i, ((start, end), params, masks) in enumerate(parts):
        if masks:
            out[i] = log_probs(constrain(logits[start:end], masks), params)
    for params, members in _alike([parts[i][1] for i in free]):
        indices = [free[m] for m in members]
        if len(indices) == 1:
            (start, end), _, _ = parts[indices[0]]
            out[indices[0]] = log_probs(logits[start:end], params)
            continue
        spans = [parts[i][0] for i in indices]
        block = log_probs(_rows(logits, [r for a, b in spans for r in range(a, b)]), params)
        at = 0
        for i, (a, b) in zip(indices, spans, strict=True):
            out[i] = block[at : at + b - a]
            at += b - a
    return out
