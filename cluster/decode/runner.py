"""A shard with the per-request state it keeps: what a node (or the local pipeline) runs.

`ShardRunner.run` takes one packed batch of step requests (at most one step per request) and
returns the hidden states for the next node or, on the tail, the step results. Requests that
cannot run (unknown id, wrong position, over the cache budget) are answered with an error of
their own and left out of the batch; the other requests of the batch run as usual.

Steps built ahead: a shard that is both head and tail (a model in one process) knows each
request's next step before anyone asks for it, but for its tokens, which are still on the
device. So before it reads a batch's tokens it builds and launches the batch that feeds them
back (mlx-lm's `generate_step` does the same with its lazy token), and the device computes
step n+1 while the host reads step n, answers it and receives the engine's next step. If that
step is the one built, its results are already under way; anything else (a stop, a request
that joined or left, a rollback or a release) first undoes the step built ahead, from a mark
of each request's caches taken before it, so every step sees exactly the caches it would have.

A node of a pipeline knows its requests' next step but not its input, which another process
sends: where every request of a batch decodes one token a step, it builds (and on CUDA
launches) the batch after it on a late input (cluster.decode.late_input) that the node rings with
the input when the step's message arrives (`plain_successors`, `build_ahead`).

With MTP (greedy, one draft a step) the next step is [the last token emitted, the draft], and
it starts where the verdict on this step's draft leaves the caches: that verdict too is still
on the device. The caches take it there (`cluster.model.cache.defer_verdicts`: the
GatedDeltaNet states it picks, the rejected draft's keys masked out), and once the host reads
it they are resolved to the positions it kept. Where that pays is measured per backend
(`mtp_lookahead_default`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx

from cluster.decode.late_input import LateInput
from cluster.decode.snapshots import PrefixSnapshot, SnapshotStore
from cluster.decode.step_cost import RoundClock, StepCost
from cluster.decode.tail import NextInput, Tail, TailJob, TailRequest, TailRequestMark
from cluster.messages import RequestError, StepRequest, StepResult, UnknownRequestError
from cluster.model.cache import CacheMark, PendingVerdicts, RequestCache, defer_verdicts
from cluster.model.layers import Segment
from cluster.model.shard import ModelShard

log = logging.getLogger(__name__)

KV_ALLOCATION_STEP = 256  # mlx-lm's KVCache grows in blocks of this many positions
RELEASED_MEMORY = 4096  # released request ids remembered, to refuse their late steps


def mtp_lookahead_default() -> bool:
    """Whether MTP steps are built ahead of their verdict by default: on the CPU, where the
    host time it hides is large against the step. On CUDA it is slower than waiting for the
    verdict, more so with many concurrent requests: the device pays for the masked attention
    and the selected states, and there is less host time to hide. Metal is not measured: off
    there as on CUDA (nothing is turned on where it may cost)."""
    return mx.default_device() == mx.cpu


class CacheBudgetError(RequestError):
    pass


@dataclass(slots=True)
class RequestState:
    cache: RequestCache
    tail: TailRequest | None
    last_used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + (self.tail.nbytes if self.tail else 0)


@dataclass(frozen=True, slots=True)
class BatchOutput:
    """`hidden` ([1, L, hidden], the rows of the requests that ran, in order) from a non-tail
    shard; `results` from the tail; `errors` for the requests that could not run."""

    steps: list[StepRequest]
    hidden: mx.array | None = None
    results: list[StepResult] = field(default_factory=list)
    errors: dict[str, RequestError] = field(default_factory=dict)
    prefix_dropped: list[int] = field(default_factory=list)  # snapshot ids no longer held


# A request's place in a packed batch: its first row, its step, its state.
Runnable = tuple[int, StepRequest, RequestState]


@dataclass(slots=True)
class _StepBuiltAhead:
    """A batch built and launched before it was asked for: each request's next step, fed the
    tokens its last step emits. `steps` hold those tokens once they are read; `marks` and
    `tail_marks` are the requests' caches from before this batch, to undo it; `undecided`,
    each request's drafts in its last step, whose verdict this batch took on the device.
    Built on a late input (a node's next step), `steps` are the expected steps with their
    tokens zeroed, `seq` what the late input waits for, and `hidden` a non-tail shard's output."""

    runnable: list[Runnable]
    jobs: list[TailJob]
    marks: list[CacheMark]
    tail_marks: list[TailRequestMark | None]  # None: a shard without the tail
    undecided: list[int]
    steps: list[StepRequest] = field(default_factory=list)
    late_input: LateInput | None = None
    seq: int = 0
    hidden: mx.array | None = None

    def matches(self, steps: list[StepRequest]) -> bool:
        """Whether `steps` is the batch built: on a late input, the same steps but for their
        tokens, whose input the late input was rung with."""
        if self.late_input is None:
            return self.steps == steps
        delivered = self.late_input.delivered(self.seq)
        return delivered and [without_tokens(s) for s in steps] == self.steps

    def holds(self, request_id: str | None) -> bool:
        return request_id is None or any(s.request_id == request_id for _, s, _ in self.runnable)


def without_tokens(step: StepRequest) -> StepRequest:
    """The step with its tokens zeroed: what a node knows of its next step in advance
    (`ShardRunner.plain_successors`)."""
    return dataclasses.replace(step, tokens=(0,) * len(step.tokens))


class ShardRunner:
    def __init__(
        self,
        shard: ModelShard,
        *,
        cache_budget_bytes: int | None = None,
        mtp_reads_prenorm: bool = False,
        prefix_budget_bytes: int | None = None,
        lookahead: bool = True,
        mtp_lookahead: bool | None = None,
    ):
        self.shard = shard
        self.spec = shard.spec
        # Steps built ahead (see the module's docstring): only a head and tail knows them.
        self.lookahead = lookahead and shard.spec.is_head and shard.spec.is_tail
        # ... and for MTP steps too, before the verdict on their draft is read (None: the
        # backend's default).
        self.mtp_lookahead = mtp_lookahead_default() if mtp_lookahead is None else mtp_lookahead
        self._ahead: _StepBuiltAhead | None = None
        self.steps_ahead_used = 0
        self.steps_ahead_undone = 0
        self.cache_budget_bytes = cache_budget_bytes
        # This shard's batches, timed; a shape's first batch, which builds it, is left out.
        self.step_cost = StepCost(drop_first=True)
        # On the tail, its requests' rounds, timed the same way: what the MTP depth policy
        # weighs drafts against.
        self.rounds = RoundClock(StepCost(drop_first=True))
        self.tail = (
            Tail(shard, mtp_reads_prenorm=mtp_reads_prenorm, round_cost=self.rounds.cost)
            if shard.spec.is_tail
            else None
        )
        self.requests: dict[str, RequestState] = {}
        # Ids released lately: a step still on its way when its request was released (a
        # client that hung up mid-prefill) must not open the request again.
        self._released: OrderedDict[str, None] = OrderedDict()
        self._kv_bytes_per_position = self._kv_position_bytes()
        self.snapshots = SnapshotStore(prefix_budget_bytes)
        self.positions_computed = 0  # by this shard's layers, over every step
        self.hidden_dtype: mx.Dtype | None = None  # of the hidden states this shard takes

    # -- the per-step path ------------------------------------------------------------------

    def run(self, steps: list[StepRequest], hidden: mx.array | None = None) -> BatchOutput:
        started = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        undecided: list[int] | None = None
        if ahead is not None and ahead.matches(steps):
            self.steps_ahead_used += 1
            undecided = ahead.undecided
            output = self._run_ahead(ahead, steps)
        else:
            if ahead is not None:
                self._undo(ahead)
            output = self._run(steps, hidden)
        finished = time.perf_counter()
        steady = self._steady(output, undecided)
        positions = context = 0
        if steady:
            for step in output.steps:
                positions += len(step.tokens)
                context = max(context, step.position + len(step.tokens))
            self.step_cost.record(positions, finished - started, context)
        if self.tail is not None and output.steps:
            ran = tuple(step.request_id for step in output.steps)
            self.rounds.batch(ran, positions if steady else None, context, finished)
        return output

    @staticmethod
    def _steady(output: BatchOutput, undecided: list[int] | None) -> bool:
        """Whether the batch's time is what such batches cost, to be recorded in the step
        cost curve: decode batches only (one confirmed token per request: a prefill chunk's
        positions cost less each, one lm_head row and no drafts); and on the tail, none of
        its requests changing its draft count (the step before a change runs the MTP head for
        a draft the step does not carry, or holds back what a plain step would run, and a
        plain step built ahead of the verdict on a draft carries that verdict's masks): what
        the adaptive depth weighs is the cost of staying at a depth."""
        if not output.steps or any(step.n_confirmed != 1 for step in output.steps):
            return False
        if not output.results:
            return True
        for i, (step, result) in enumerate(zip(output.steps, output.results, strict=True)):
            if len(result.drafts) != step.draft_len:
                return False
            if not step.draft_len and undecided is not None and undecided[i]:
                return False
        return True

    def _run(self, steps: list[StepRequest], hidden: mx.array | None) -> BatchOutput:
        errors: dict[str, RequestError] = {}
        runnable: list[Runnable] = []
        start = 0
        for step in steps:
            try:
                runnable.append((start, step, self._prepare(step)))
            except RequestError as error:
                errors[step.request_id] = error
            start += len(step.tokens)
        if not runnable:
            return BatchOutput([], errors=errors)
        ran = [step for _, step, _ in runnable]
        if self.spec.is_head:
            tokens = [t for step in ran for t in step.tokens]
            x = self.shard.embed(mx.array(tokens)[None])
        else:
            if hidden is None:
                raise RequestError("a non-head shard needs the hidden states of the step")
            if hidden.shape[1] != start:
                raise RequestError(f"hidden states hold {hidden.shape[1]} positions, steps {start}")
            x = hidden if len(ran) == len(steps) else self._rows(hidden, runnable)
            self.hidden_dtype = hidden.dtype
        segments = []
        for _, step, state in runnable:
            state.cache.begin_step(step.rollback, len(step.tokens))
            segments.append(Segment(state.cache, len(step.tokens), step.n_confirmed))
        out = self.shard(x, segments)
        self.positions_computed += x.shape[1]
        if self.tail is None:
            mx.eval(out)
            dropped = self._save_prefixes(runnable)
            return BatchOutput(ran, hidden=out, errors=errors, prefix_dropped=dropped)
        jobs = self.tail.launch(ran, [state.tail for _, _, state in runnable], out)
        return self._conclude(runnable, jobs, errors)

    def _conclude(
        self, runnable: list[Runnable], jobs: list[TailJob], errors: dict[str, RequestError]
    ) -> BatchOutput:
        """The tail's results of a launched batch; first, where it can, the batch after it."""
        if self.lookahead:
            self._ahead = self._start_ahead(runnable, jobs)
        results = self.tail.conclude(jobs)
        if self._ahead is not None:
            self._ahead = self._read_verdicts(self._ahead, jobs)
        if self._ahead is not None:
            self._ahead.steps = [
                StepRequest(
                    step.request_id,
                    (result.tokens[-1], *result.drafts),
                    step.position + result.keep,
                    draft_len=len(result.drafts),
                    rollback=len(step.tokens) - result.keep,
                )
                for (_, step, _), result in zip(runnable, results, strict=True)
            ]
        dropped = self._save_prefixes(runnable)
        ran = [step for _, step, _ in runnable]
        return BatchOutput(ran, results=results, errors=errors, prefix_dropped=dropped)

    def _start_ahead(self, runnable: list[Runnable], jobs: list[TailJob]) -> _StepBuiltAhead | None:
        """Build and launch the batch that feeds each request the tokens it is about to emit,
        where the device alone fixes every request's next step (`Tail.next_input`); None
        where not."""
        nexts = [Tail.next_input(job, before_verdict=self.mtp_lookahead) for job in jobs]
        if any(n is None for n in nexts) or any(step.prefix_save for _, step, _ in runnable):
            return None  # (a prefix snapshot reads the caches after this step: not ahead)
        states = [state for _, _, state in runnable]
        try:
            for state, following in zip(states, nexts, strict=True):
                self._check_budget(state, 1 + following.drafts)
        except CacheBudgetError:
            return None  # the engine's own step will say so
        marks = [state.cache.mark() for state in states]
        tail_marks = [state.tail.mark() for state in states]
        undecided = [following.undecided for following in nexts]
        try:
            ahead, jobs = self._launch_ahead(runnable, nexts, undecided)
        except BaseException:
            for state, mark, tail_mark in zip(states, marks, tail_marks, strict=True):
                state.cache.restore(mark)
                state.tail.restore(tail_mark)
            raise
        return _StepBuiltAhead(ahead, jobs, marks, tail_marks, undecided)

    def _launch_ahead(
        self, runnable: list[Runnable], nexts: list[NextInput], undecided: list[int]
    ) -> tuple[list[Runnable], list[TailJob]]:
        """`_start_ahead`'s build: the verdicts taken on the device, the batch, its tail."""
        states = [state for _, _, state in runnable]
        if any(undecided):
            verdicts = PendingVerdicts([following.accepted for following in nexts], undecided)
            defer_verdicts([state.cache for state in states], verdicts, list(range(len(states))))
            mtp = [(row, s.tail.mtp_cache) for row, s in enumerate(states) if s.tail.mtp_cache]
            defer_verdicts([cache for _, cache in mtp], verdicts, [row for row, _ in mtp])
        # Each step's tokens are placeholders until they are read (its position too, until
        # the verdict is): the layers take them on the device.
        ahead: list[Runnable] = []
        segments = []
        start = 0
        for (_, step, state), following in zip(runnable, nexts, strict=True):
            length = 1 + following.drafts
            position = step.position + len(step.tokens)
            placeholder = StepRequest(
                step.request_id, (0,) * length, position, draft_len=following.drafts
            )
            ahead.append((start, placeholder, state))
            state.cache.begin_step(0, length)
            segments.append(Segment(state.cache, length, 1))
            start += length
        tokens = [following.tokens for following in nexts]
        out = self.shard(self.shard.embed(mx.concatenate(tokens)[None]), segments)
        steps = [step for _, step, _ in ahead]
        jobs = self.tail.launch(steps, [state.tail for state in states], out, tokens)
        return ahead, jobs

    def _read_verdicts(self, ahead: _StepBuiltAhead, jobs: list[TailJob]) -> _StepBuiltAhead | None:
        """The verdicts of the batch that `ahead` follows, read: resolve the caches that took
        them on the device. Where the host decided otherwise than the device (a decision
        replaced on the host alone), the batch built on the device's is undone instead."""
        drops = [k - job.accepted for k, job in zip(ahead.undecided, jobs, strict=True)]
        if any(job.verdict is not None and job.verdict.item() != job.accepted for job in jobs):
            self._undo(ahead)
            for (_, _, state), drop in zip(ahead.runnable, drops, strict=True):
                if drop and state.tail.mtp_cache is not None:  # what the tail left to us
                    state.tail.mtp_cache.rollback(drop)
            return None
        if not any(ahead.undecided):
            return ahead
        for i, ((_, _, state), drop) in enumerate(zip(ahead.runnable, drops, strict=True)):
            state.cache.resolve(drop)
            if state.tail.mtp_cache is not None:
                state.tail.mtp_cache.resolve(drop)
                # Undone now, the batch leaves the MTP cache as the tail's verdict left it.
                ahead.tail_marks[i] = ahead.tail_marks[i].trimmed(drop)
        return ahead

    def _run_ahead(self, ahead: _StepBuiltAhead, steps: list[StepRequest]) -> BatchOutput:
        """The batch built ahead, now asked for: conclude it (building the one after)."""
        if ahead.late_input is not None:
            ahead.steps = steps  # the tokens the late input was rung with
        runnable = []
        now = time.monotonic()
        for i, ((row, _, state), step) in enumerate(zip(ahead.runnable, ahead.steps, strict=True)):
            if ahead.jobs:
                ahead.jobs[i].step = step  # the tokens and position, read since
            state.last_used = now
            runnable.append((row, step, state))
            self.positions_computed += len(step.tokens)
        if self.tail is None:
            mx.eval(ahead.hidden)
            return BatchOutput([step for _, step, _ in runnable], hidden=ahead.hidden)
        return self._conclude(runnable, ahead.jobs, {})

    # -- a node's next step, built on a late input -------------------------------------------

    def ahead_matches(self, steps: list[StepRequest]) -> bool:
        """Whether `run(steps)` will take the batch built ahead (and needs no input)."""
        return self._ahead is not None and self._ahead.matches(steps)

    def plain_successors(self, steps: list[StepRequest]) -> list[StepRequest] | None:
        """The batch expected after `steps` (tokens zeroed), where a node can build it ahead:
        `steps` held every request of this shard, each decoding one token with nothing else
        asked (no drafts, rollback, masks, snapshots or MTP head), so the next batch is likely
        the same requests one position on. None elsewhere: with micro-batches or MTP the next
        batch differs, and a batch built for nothing costs the device a step; and on a shard
        that builds ahead on its own tokens (`lookahead`)."""
        if self.lookahead or not steps or len(steps) != len(self.requests):
            return None
        successors = []
        for step in steps:
            state = self.requests.get(step.request_id)
            plain = StepRequest(step.request_id, (0,), step.position)
            if state is None or without_tokens(step) != plain:
                return None
            if state.tail is not None and state.tail.mtp_cache is not None:
                return None
            successors.append(StepRequest(step.request_id, (0,), step.position + 1))
        return successors

    def input_nbytes(self, steps: list[StepRequest]) -> int | None:
        """The bytes of a late input's input for `steps`: token ids at the head, hidden states
        elsewhere (None before this shard has seen any)."""
        if self.spec.is_head:
            return 4 * len(steps)
        if self.hidden_dtype is None:
            return None
        return len(steps) * self.shard.hidden_size * self.hidden_dtype.size

    def build_ahead(self, steps: list[StepRequest], late_input: LateInput, seq: int) -> bool:
        """Build `steps` (from `plain_successors`) on `late_input`'s input `seq`, and where the
        late_input allows, launch them: `run` uses them if the node rings the late input with the
        input of the same steps; anything else undoes them. False where nothing was built."""
        self.settle()
        states = [self.requests.get(step.request_id) for step in steps]
        for state, step in zip(states, steps, strict=True):
            if state is None or state.cache.position != step.position:
                return False
        try:
            for state in states:
                self._check_budget(state, 1)
        except CacheBudgetError:
            return False
        if not self.spec.is_head and self.hidden_dtype is None:
            return False
        marks = [state.cache.mark() for state in states]
        tail_marks = [state.tail.mark() if state.tail else None for state in states]
        launch = late_input.launches_ahead
        try:
            if self.spec.is_head:
                x = self.shard.embed(late_input.input(seq, (len(steps),), mx.uint32)[None])
            else:
                shape = (1, len(steps), self.shard.hidden_size)
                x = late_input.input(seq, shape, self.hidden_dtype)
            segments = []
            for state in states:
                state.cache.begin_step(0, 1)
                segments.append(Segment(state.cache, 1, 1))
            out = self.shard(x, segments, launch=launch)
            jobs: list[TailJob] = []
            if self.tail is not None:
                tails = [state.tail for state in states]
                jobs = self.tail.launch(steps, tails, out, start=launch)
            elif launch:
                mx.async_eval(out)
        except BaseException:
            for state, mark, tail_mark in zip(states, marks, tail_marks, strict=True):
                state.cache.restore(mark)
                if tail_mark is not None:
                    state.tail.restore(tail_mark)
            raise
        runnable = list(zip(range(len(steps)), steps, states, strict=True))  # a row each
        self._ahead = _StepBuiltAhead(
            runnable, jobs, marks, tail_marks, [0] * len(steps), steps=steps,
            late_input=late_input, seq=seq, hidden=None if self.tail is not None else out,
        )  # fmt: skip
        return True

    def _undo(self, ahead: _StepBuiltAhead) -> None:
        """Take back a batch built ahead that was not asked for: the caches as before it."""
        self.steps_ahead_undone += 1
        for (_, _, state), mark, tail_mark in zip(
            ahead.runnable, ahead.marks, ahead.tail_marks, strict=True
        ):
            state.cache.restore(mark)
            if tail_mark is not None:
                state.tail.restore(tail_mark)

    def settle(self, request_id: str | None = None) -> None:
        """Undo the batch built ahead if it holds `request_id` (None: whatever it holds):
        before anything but a step touches the requests' caches."""
        if self._ahead is not None and self._ahead.holds(request_id):
            ahead, self._ahead = self._ahead, None
            self._undo(ahead)

    def _prepare(self, step: StepRequest) -> RequestState:
        self._check_tokens(step)
        state = self.requests.get(step.request_id)
        if state is None:
            if step.request_id in self._released:
                raise UnknownRequestError(f"request {step.request_id!r} was released")
            if step.prefix_from:
                state = self._open_from_prefix(step)
            elif step.position != 0:
                raise UnknownRequestError(f"unknown request id {step.request_id!r}")
            else:
                state = self._open(step)
        expected = state.cache.position - step.rollback
        if step.rollback > state.cache.last_step_len or expected != step.position:
            raise RequestError(
                f"request {step.request_id!r}: step at position {step.position} with rollback "
                f"{step.rollback}, but the caches hold {state.cache.position} positions"
            )
        if state.tail is not None:
            Tail.check_drafts(state.tail, step)
        self._check_budget(state, len(step.tokens))
        state.last_used = time.monotonic()
        return state

    def _check_tokens(self, step: StepRequest) -> None:
        """Token ids come off the wire: one outside the vocabulary would index past the
        embedding (garbage, or a crash on the device), so it is refused here."""
        vocab = self.shard.vocab_size
        tokens = step.tokens if step.next_token is None else (*step.tokens, step.next_token)
        if not all(0 <= token < vocab for token in tokens):
            bad = next(token for token in tokens if not 0 <= token < vocab)
            raise RequestError(
                f"request {step.request_id!r}: token id {bad} is outside the vocabulary "
                f"[0, {vocab})"
            )

    def _open(self, step: StepRequest) -> RequestState:
        tail = self.tail.open(step.options) if self.tail else None
        state = RequestState(RequestCache.for_layers(self.shard.linear_flags), tail)
        self._check_budget(state, len(step.tokens))
        self.requests[step.request_id] = state
        return state

    def _open_from_prefix(self, step: StepRequest) -> RequestState:
        snapshot = self.snapshots.get(step.prefix_from)
        if snapshot.position != step.position:
            raise RequestError(
                f"request {step.request_id!r}: prefix snapshot {step.prefix_from} holds "
                f"{snapshot.position} positions, the step starts at {step.position}"
            )
        tail = None
        if self.tail is not None:
            if snapshot.tail is None:
                raise RequestError(f"prefix snapshot {step.prefix_from} has no tail state")
            tail = snapshot.tail.open(self.tail, step.options)
        state = RequestState(snapshot.cache.restore(), tail)
        self._check_budget(state, len(step.tokens))
        self.requests[step.request_id] = state
        return state

    def _save_prefixes(self, runnable: list[Runnable]) -> list[int]:
        """Snapshots asked for at the end of this step (its positions are all confirmed)."""
        dropped: list[int] = []
        for _, step, state in runnable:
            if not step.prefix_save:
                continue
            if state.tail is not None:
                self.tail.feed_unfed(state.tail)
            try:
                snapshot = PrefixSnapshot.take(state.cache, state.tail, state.cache.position)
            except ValueError as error:  # e.g. asked of a chunk that is not the prompt's last
                log.warning("no prefix snapshot of %s: %s", step.request_id, error)
                dropped.append(step.prefix_save)
                continue
            dropped += self.snapshots.put(step.prefix_save, snapshot)
        return dropped

    @staticmethod
    def _rows(hidden: mx.array, runnable: list[Runnable]) -> mx.array:
        return mx.concatenate(
            [hidden[:, s : s + len(step.tokens)] for s, step, _ in runnable], axis=1
        )

    # -- memory -----------------------------------------------------------------------------

    def _kv_position_bytes(self) -> int:
        """Bytes one position adds to this shard's attention caches (and the MTP head's)."""
        per = 0
        attention = [layer.self_attn for layer in self.shard.layers if not layer.is_linear]
        if self.shard.has_mtp:
            attention += [layer.self_attn for layer in self.shard.mtp.layers]
        for attn in attention:
            per += 2 * attn.num_key_value_heads * attn.head_dim * 2  # keys + values, 16-bit
        return per

    def _growth_bytes(self, state: RequestState, n_tokens: int) -> int:
        position = state.cache.position
        blocks_now = -(-position // KV_ALLOCATION_STEP)
        blocks_next = -(-(position + n_tokens) // KV_ALLOCATION_STEP)
        return (blocks_next - blocks_now) * KV_ALLOCATION_STEP * self._kv_bytes_per_position

    def _check_budget(self, state: RequestState, n_tokens: int) -> None:
        if self.cache_budget_bytes is None:
            return
        needed = self._growth_bytes(state, n_tokens)
        used = self.cache_bytes
        if used + needed > self.cache_budget_bytes:
            raise CacheBudgetError(
                f"cache budget exhausted on {self.spec.describe()}: {used} bytes in use, "
                f"{needed} more needed, budget {self.cache_budget_bytes}"
            )

    @property
    def cache_bytes(self) -> int:
        return sum(state.nbytes for state in self.requests.values())

    # -- lifetime ---------------------------------------------------------------------------

    def rollback(self, request_id: str, drop: int) -> int:
        """The standalone trim-and-restore signal; returns the position now held."""
        self.settle(request_id)
        state = self.requests.get(request_id)
        if state is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        try:
            state.cache.rollback(drop)
        except ValueError as error:
            raise RequestError(str(error)) from None
        return state.cache.position

    def release_as_prefix(
        self, request_id: str, snapshot_id: int, positions: int
    ) -> tuple[bool, list[int]]:
        """Release a request, keeping its first `positions` positions (all but what its last
        step's rollback would drop) as a prefix snapshot. Returns whether the snapshot is held
        and the ids of the snapshots no longer held."""
        self.settle(request_id)
        state = self.requests.get(request_id)
        self.release(request_id)
        if state is None:
            return False, [snapshot_id]
        drop = state.cache.position - positions
        if not 0 <= drop <= state.cache.last_step_len or positions < 1:
            return False, [snapshot_id]
        try:
            if drop:
                state.cache.rollback(drop)
            if state.tail is not None:
                self.tail.feed_unfed(state.tail)
            snapshot = PrefixSnapshot.take(state.cache, state.tail, positions)
        except ValueError as error:
            log.warning("no prefix snapshot of %s: %s", request_id, error)
            return False, [snapshot_id]
        dropped = self.snapshots.put(snapshot_id, snapshot)
        return snapshot_id not in dropped, dropped

    def release(self, request_id: str) -> bool:
        self.settle(request_id)
        self._released[request_id] = None
        if len(self._released) > RELEASED_MEMORY:
            self._released.popitem(last=False)
        return self.requests.pop(request_id, None) is not None

    def close(self) -> None:
        """Drop every request and snapshot: the shard is replaced (a new placement). A step
        stream still open to the old stage must not keep their caches alive."""
        self._ahead = None
        self.requests.clear()
        self.snapshots.clear()

    def evict_idle(self, idle_seconds: float) -> list[str]:
        now = time.monotonic()
        stale = [rid for rid, s in self.requests.items() if now - s.last_used > idle_seconds]
        for rid in stale:
            self.settle(rid)
            del self.requests[rid]
        return stale
