"""A pipeline wrapper that makes greedy decode steps reject their drafts where a test wants.

The bundled model accepts most first drafts and a random-weight fixture almost none, so
neither rejects at every position of a deep step on its own. `ForcedRejections` rewrites each
decode step's drafts before it enters the pipeline: the first i-1 are the target's own
continuation (from an oracle: the greedy output of a run without MTP), so they pass; the i-th
is wrong, so the step rejects there; i cycles through 1..k+1 (k+1: every draft passes). Greedy
verification is an exact match against the target, so the tail verifies any drafts exactly.

It also keeps the requests' state when the engine releases them (`keep_state`), so that a test
can compare every cache of the run with a run that never saw a draft, after `settle`.
"""

from __future__ import annotations

from collections import Counter

from cluster.decode.pipeline import Pipeline
from cluster.decode.runner import ShardRunner
from cluster.messages import StepRequest, StepResult

VOCAB = 8192  # the bundled model's, and the fixtures'


class ForcedRejections:
    def __init__(
        self,
        inner: Pipeline,
        oracle: dict[str, tuple[int, ...]],
        *,
        keep_state: bool = False,
        stagger: bool = False,
    ):
        """`oracle`: request id -> prompt + greedy output without MTP (tokens by position).
        `stagger`: the n-th request seen starts its cycle n places on, so that requests
        decoding in one batch reject at different positions in each step."""
        self.inner = inner
        self.oracle = oracle
        self.keep_state = keep_state
        self.stagger = stagger
        self.forced: Counter[tuple[int, int]] = Counter()  # (drafts, rejected at; k+1: none)
        self.last: dict[str, tuple[StepRequest, StepResult]] = {}
        self.held: list[str] = []  # the run ids whose release was held back
        self._cycle: Counter[str] = Counter()

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    async def submit(self, step: StepRequest) -> StepResult:
        if step.draft_len:
            step = self._rewrite(step)
        result = await self.inner.submit(step)
        self.last[step.request_id] = (step, result)
        return result

    async def release(self, request_id: str) -> None:
        if self.keep_state:
            self.held.append(request_id)
        else:
            await self.inner.release(request_id)

    def _rewrite(self, step: StepRequest) -> StepRequest:
        sequence = self.oracle[step.request_id.split(".")[0]]
        k, p = step.draft_len, step.position
        if p + k >= len(sequence):
            return step
        assert step.tokens[0] == sequence[p], "the run left the oracle's path"
        drafts = list(sequence[p + 1 : p + 1 + k])
        if self.stagger and step.request_id not in self._cycle:
            self._cycle[step.request_id] = len(self._cycle)
        reject_at = self._cycle[step.request_id] % (k + 1) + 1
        self._cycle[step.request_id] += 1
        if reject_at <= k:
            drafts[reject_at - 1] = (drafts[reject_at - 1] + 1) % VOCAB
        self.forced[(k, reject_at)] += 1
        return StepRequest(
            step.request_id,
            (step.tokens[0], *drafts),
            step.position,
            draft_len=k,
            rollback=step.rollback,
            sample=step.sample,
            options=step.options,
        )

    def settle(self, runners: list[ShardRunner]) -> None:
        """Undo any step built ahead, apply the last step's pending rollback on every shard and
        drop the MTP cache's chained-draft entries: what the next step would do before
        computing anything."""
        for run_id in self.held:
            step, result = self.last[run_id]
            for runner in runners:
                runner.settle(run_id)
                if len(step.tokens) > result.keep:
                    runner.rollback(run_id, len(step.tokens) - result.keep)
                tail = runner.requests[run_id].tail
                if tail is not None:
                    tail.discard_speculative()
