"""A shard with the per-request state it keeps: what a node (or the local pipeline) runs.

`ShardRunner.run` takes one packed batch of step requests (at most one step per request) and
returns the hidden states for the next node or, on the tail, the step results. Requests that
cannot run (unknown id, wrong position, over the cache budget) are answered with an error of
their own and left out of the batch; the other requests of the batch run as usual.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx

from cluster.decode.snapshots import PrefixSnapshot, SnapshotStore
from cluster.decode.step_cost import StepCost
from cluster.decode.tail import Tail, TailRequest
from cluster.messages import RequestError, StepRequest, StepResult, UnknownRequestError
from cluster.model.cache import RequestCache
from cluster.model.layers import Segment
from cluster.model.shard import ModelShard

log = logging.getLogger(__name__)

KV_ALLOCATION_STEP = 256  # mlx-lm's KVCache grows in blocks of this many positions
RELEASED_MEMORY = 4096  # released request ids remembered, to refuse their late steps


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


class ShardRunner:
    def __init__(
        self,
        shard: ModelShard,
        *,
        cache_budget_bytes: int | None = None,
        mtp_reads_prenorm: bool = False,
        prefix_budget_bytes: int | None = None,
    ):
        self.shard = shard
        self.spec = shard.spec
        self.cache_budget_bytes = cache_budget_bytes
        self.step_cost = StepCost()  # this shard's batches, timed (read by the MTP depth policy)
        self.tail = (
            Tail(shard, mtp_reads_prenorm=mtp_reads_prenorm, step_cost=self.step_cost)
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

    # -- the per-step path ------------------------------------------------------------------

    def run(self, steps: list[StepRequest], hidden: mx.array | None = None) -> BatchOutput:
        started = time.perf_counter()
        output = self._run(steps, hidden)
        # Decode batches only (one confirmed token per request): a prefill chunk's positions
        # cost less each (one lm_head row, no drafts), and would bend the decode curve.
        if output.steps and all(step.n_confirmed == 1 for step in output.steps):
            positions = sum(len(step.tokens) for step in output.steps)
            self.step_cost.record(positions, time.perf_counter() - started)
        return output

    def _run(self, steps: list[StepRequest], hidden: mx.array | None) -> BatchOutput:
        errors: dict[str, RequestError] = {}
        runnable: list[tuple[int, StepRequest, RequestState]] = []
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
        results = self.tail.finish(ran, [state.tail for _, _, state in runnable], out)
        dropped = self._save_prefixes(runnable)
        return BatchOutput(ran, results=results, errors=errors, prefix_dropped=dropped)

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

    def _save_prefixes(self, runnable: list[tuple[int, StepRequest, RequestState]]) -> list[int]:
        """Snapshots asked for at the end of this step (its positions are all confirmed)."""
        dropped: list[int] = []
        for _, step, state in runnable:
            if not step.prefix_save:
                continue
            try:
                snapshot = PrefixSnapshot.take(state.cache, state.tail, state.cache.position)
            except ValueError as error:  # e.g. asked of a chunk that is not the prompt's last
                log.warning("no prefix snapshot of %s: %s", step.request_id, error)
                dropped.append(step.prefix_save)
                continue
            dropped += self.snapshots.put(step.prefix_save, snapshot)
        return dropped

    @staticmethod
    def _rows(hidden: mx.array, runnable: list[tuple[int, StepRequest, RequestState]]) -> mx.array:
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
            snapshot = PrefixSnapshot.take(state.cache, state.tail, positions)
        except ValueError as error:
            log.warning("no prefix snapshot of %s: %s", request_id, error)
            return False, [snapshot_id]
        dropped = self.snapshots.put(snapshot_id, snapshot)
        return snapshot_id not in dropped, dropped

    def release(self, request_id: str) -> bool:
        self._released[request_id] = None
        if len(self._released) > RELEASED_MEMORY:
            self._released.popitem(last=False)
        return self.requests.pop(request_id, None) is not None

    def close(self) -> None:
        """Drop every request and snapshot: the shard is replaced (a new placement). A step
        stream still open to the old stage must not keep their caches alive."""
        self.requests.clear()
        self.snapshots.clear()

    def evict_idle(self, idle_seconds: float) -> list[str]:
        now = time.monotonic()
        stale = [rid for rid, s in self.requests.items() if now - s.last_used > idle_seconds]
        for rid in stale:
            del self.requests[rid]
        return stale
