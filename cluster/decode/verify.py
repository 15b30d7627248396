"""Verification of MTP drafts against the target model, greedy or lossless-sampled.

Work is split in two so that a batch of requests pays one device sync: `propose` builds, lazily,
every token the step could emit (the target's choice at each position, whether each draft
passes, the correction if it fails); the caller evaluates all requests' candidates together;
`decide` then walks them in Python.

Sampled verification is the standard speculative-sampling rule: accept draft d with
probability min(1, p(d)/q(d)); on rejection draw from the residual max(p - q, 0) / Z. The
emitted tokens are then distributed exactly as the target model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from cluster.decode.sampling import RequestRandom, draw
from cluster.messages import SamplingParams


@dataclass(frozen=True, slots=True)
class Candidates:
    target: mx.array  # [k+1]: the target's own token at each position
    accept: mx.array | None  # [k]: whether each draft passes
    correction: mx.array | None  # [k]: the token to emit if the draft at that position fails

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.target, self.accept, self.correction) if a is not None]


def propose(
    target_logprobs: mx.array,
    drafts: tuple[int, ...] | mx.array,
    draft_logprobs: mx.array | None,
    params: SamplingParams,
    rng: RequestRandom,
) -> Candidates:
    """target_logprobs: [k+1, vocab] at the last confirmed position and each draft;
    draft_logprobs: [k, vocab], the distributions the drafts were drawn from. `drafts` may
    still be on the device (a step built before the drafts were read)."""
    if params.greedy:
        target = mx.argmax(target_logprobs, axis=-1)
    else:  # the target's probabilities serve its own draw and the drafts' verdicts
        target_probs = mx.exp(target_logprobs)
        target = draw(target_probs, rng)
    if len(drafts) == 0:
        return Candidates(target, None, None)
    d = drafts if isinstance(drafts, mx.array) else mx.array(drafts)
    if params.greedy:
        return Candidates(target, target[: len(drafts)] == d, target[: len(drafts)])
    if draft_logprobs is None:
        raise ValueError("sampled verification needs the draft distribution")
    p = target_probs[: len(drafts)]
    q = mx.exp(draft_logprobs)
    p_d = mx.take_along_axis(p, d[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
    u = rng.uniform((len(drafts),))
    accept = u * q_d < p_d  # u < p/q without dividing by a zero q
    # p == q leaves no residual mass; then the draft is always accepted and the value unused.
    correction = draw(mx.maximum(p - q, 0.0), rng)
    return Candidates(target, accept, correction)


def decide(
    candidates: Candidates, drafts: tuple[int, ...], forced: int | None = None
) -> tuple[tuple[int, ...], int]:
    """The emitted tokens and how many drafts were accepted (candidates evaluated). `forced`
    (tests and benchmarks): accept that many drafts whatever the candidates say, then emit
    the target's token after them (the correction where a draft is refused)."""
    target = candidates.target.tolist()
    if not drafts:
        return (target[0],), 0
    if forced is not None:
        i = min(max(forced, 0), len(drafts))
        if i == len(drafts):
            return (*drafts, target[i]), i
        return (*drafts[:i], int(candidates.correction[i].item())), i
    accept = candidates.accept.tolist()
    correction = candidates.correction.tolist()
    for i in range(len(drafts)):
        if not accept[i]:
            return (*drafts[:i], correction[i]), i
    return (*drafts, target[len(drafts)]), len(drafts)
