"""The tail's work after its layers: tokens out, drafts verified, the next draft made.

Only the tail turns hidden states into tokens. For each request of a step it
1. computes logits at the last confirmed position and at each draft (one lm_head matmul for
   the whole batch),
2. samples or verifies (cluster.verify), which fixes how many of the step's positions stay,
3. feeds the MTP head the newly confirmed (hidden state, next token) pairs and drafts the
   token after the last emitted one.
One device sync after 2 and one after 3, for the whole batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx

from cluster.cache import RequestCache
from cluster.layers import Segment
from cluster.messages import RequestOptions, SamplingParams, StepRequest, StepResult
from cluster.sampling import RequestRandom, log_probs, sample
from cluster.shard import ModelShard
from cluster.verify import Candidates, decide, propose

_PLAIN = SamplingParams()  # greedy params: log_probs gives the model's own distribution


@dataclass(slots=True)
class TailRequest:
    """What the tail keeps for one request between steps."""

    options: RequestOptions
    rng: RequestRandom
    mtp_cache: RequestCache | None
    # The MTP input of the last confirmed position whose next token is not known yet
    # (the end of a prefill chunk that is not the prompt's last).
    pending_hidden: mx.array | None = None
    draft: int | None = None
    draft_logprobs: mx.array | None = None  # [vocab], the distribution `draft` came from

    @property
    def nbytes(self) -> int:
        return self.mtp_cache.nbytes if self.mtp_cache else 0


class Tail:
    def __init__(self, shard: ModelShard, *, mtp_reads_prenorm: bool = False):
        self.shard = shard
        self.mtp_reads_prenorm = mtp_reads_prenorm

    def open(self, options: RequestOptions | None) -> TailRequest:
        options = options or RequestOptions()
        use_mtp = options.mtp and self.shard.has_mtp
        mtp_cache = (
            RequestCache.for_layers([False] * len(self.shard.mtp.layers)) if use_mtp else None
        )
        return TailRequest(options, RequestRandom(options.sampling.seed), mtp_cache)

    def finish(
        self, steps: list[StepRequest], states: list[TailRequest], hidden: mx.array
    ) -> list[StepResult]:
        normed = self.shard.norm(hidden)
        mtp_input = hidden if self.mtp_reads_prenorm else normed

        # 1. logits where a token is due: the last confirmed position and each draft.
        offsets, rows = [], []
        start = 0
        for step in steps:
            offsets.append(start)
            if step.sample:
                first = start + step.n_confirmed - 1
                rows.extend(range(first, start + len(step.tokens)))
            start += len(step.tokens)
        logits = self.shard.logits(normed[0, mx.array(rows)]) if rows else None

        # 2. sample or verify, one sync for the batch.
        proposals: list[Candidates | None] = []
        plain: dict[int, mx.array] = {}  # the model's own log-probabilities, where asked for
        row = 0
        for i, (step, state) in enumerate(zip(steps, states, strict=True)):
            if not step.sample:
                proposals.append(None)
                continue
            n = step.draft_len + 1
            drafts = step.tokens[step.n_confirmed :]
            params = state.options.sampling
            target = log_probs(logits[row : row + n], params)
            q = state.draft_logprobs[None] if drafts and not params.greedy else None
            proposals.append(propose(target, drafts, q, params, state.rng))
            if state.options.logprobs:
                plain[i] = log_probs(logits[row : row + n], _PLAIN)
            row += n
        mx.eval([a for p in proposals if p is not None for a in p.arrays()], *plain.values())

        results: list[StepResult] = []
        feeds: list[_MTPFeed] = []
        for i, (step, state, offset, proposal) in enumerate(
            zip(steps, states, offsets, proposals, strict=True)
        ):
            if proposal is None:  # a prefill chunk with more of the prompt to come
                emitted, accepted, keep = (), 0, len(step.tokens)
                follow = step.tokens[1:]
                rows = mtp_input[:, offset : offset + keep - 1]
                pending = mtp_input[:, offset + keep - 1 : offset + keep]
            else:
                emitted, accepted = decide(proposal, step.tokens[step.n_confirmed :])
                keep = step.n_confirmed + accepted
                follow = (*step.tokens[1:keep], emitted[-1])
                rows = mtp_input[:, offset : offset + keep]
                pending = None
            logprobs = None
            if i in plain:  # emitted token j was predicted at row j
                logprobs = tuple(plain[i][j, t].item() for j, t in enumerate(emitted))
            results.append(
                StepResult(step.request_id, emitted, keep, None, step.draft_len, accepted, logprobs)
            )
            if state.mtp_cache is not None:
                if state.pending_hidden is not None:
                    rows = mx.concatenate([state.pending_hidden, rows], axis=1)
                    follow = (step.tokens[0], *follow)
                state.pending_hidden = pending
                if follow:
                    feeds.append(_MTPFeed(len(results) - 1, state, rows, follow, step.sample))

        # 3. feed the MTP head and draft the next token, one sync for the batch.
        for feed, draft in zip(feeds, self._feed_mtp(feeds), strict=True):
            if draft is not None:
                r = results[feed.result_index]
                results[feed.result_index] = StepResult(
                    r.request_id, r.tokens, r.keep, draft, r.drafted, r.accepted, r.logprobs
                )
        return results

    def _feed_mtp(self, feeds: list[_MTPFeed]) -> list[int | None]:
        """Run the MTP head over every request's new pairs; draft where a draft is due."""
        if not feeds:
            return []
        segments = []
        for feed in feeds:
            feed.state.mtp_cache.begin_step(0, len(feed.tokens))
            segments.append(Segment(feed.state.mtp_cache, len(feed.tokens), len(feed.tokens)))
        hidden = (
            mx.concatenate([f.hidden for f in feeds], axis=1) if len(feeds) > 1 else feeds[0].hidden
        )
        tokens = mx.array([t for f in feeds for t in f.tokens])[None]
        out = self.shard.mtp(self.shard.embed(tokens), hidden, segments)
        ends = list(itertools.accumulate(len(f.tokens) for f in feeds))
        logits = self.shard.logits(out[0, mx.array([e - 1 for e in ends])])
        sampled: list[tuple[mx.array, mx.array] | None] = []
        for i, feed in enumerate(feeds):
            if not feed.draft:
                sampled.append(None)
                continue
            params = feed.state.options.sampling
            q = log_probs(logits[i], params)
            sampled.append((sample(q, params, feed.state.rng), q))
        mx.eval(
            [a for pair in sampled if pair for a in pair]
            + [a for f in feeds for a in f.state.mtp_cache.arrays()]
        )
        drafts: list[int | None] = []
        for feed, pair in zip(feeds, sampled, strict=True):
            if pair is None:
                drafts.append(None)
                continue
            feed.state.draft = int(pair[0].item())
            feed.state.draft_logprobs = pair[1]
            drafts.append(feed.state.draft)
        return drafts


@dataclass(slots=True)
class _MTPFeed:
    """New (hidden state, next token) pairs of one request for the MTP head."""

    result_index: int
    state: TailRequest
    hidden: mx.array  # [1, pairs, hidden]
    tokens: tuple[int, ...]
    draft: bool  # whether a draft is due after them
