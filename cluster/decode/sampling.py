"""From logits to a distribution and a token, as the request's sampling parameters say.

The filters apply in a fixed order: temperature, then top-k, then top-p (nucleus), then
min-p. The same transform applies to the target model and to the MTP draft, so that the
verifier compares the two distributions a token was actually drawn from.
"""

from __future__ import annotations

import os

import mlx.core as mx

from cluster.messages import SamplingParams


def log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities [..., vocab] after temperature and the filters (-inf = filtered).

    Greedy requests get the plain softmax (their logprobs, if asked for). No filter sorts the
    vocabulary: top-k takes its k-th largest logit from a partition, and top-p sorts only what
    can pass it (top-k's k survivors where top-k is on), then keeps every token at or above the
    last one it admits. Sorting a 250k vocabulary costs more than the rest of sampling
    together, and an MTP step samples several rows of it.
    """
    logits = logits.astype(mx.float32)
    if params.greedy:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    logits = logits / params.temperature
    top_k = params.top_k if 0 < params.top_k < logits.shape[-1] else 0
    if top_k:
        kth = mx.topk(logits, top_k, axis=-1).min(axis=-1, keepdims=True)
        logits = mx.where(logits < kth, -mx.inf, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.top_p < 1.0:
        logprobs = _nucleus(logprobs, params.top_p, top_k)
    if params.min_p > 0.0:
        top = mx.max(logprobs, axis=-1, keepdims=True)
        logprobs = mx.where(logprobs < top + mx.log(mx.array(params.min_p)), -mx.inf, logprobs)
    if params.top_p < 1.0 or params.min_p > 0.0:
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    return logprobs


def _nucleus(logprobs: mx.array, top_p: float, top_k: int) -> mx.array:
    """Top-p: the likeliest tokens while the mass before them is below `top_p` (the first
    always stays), and every token tied with the last of them, so that the kept set depends on
    the values alone and not on how a sort orders equal ones. With top-k on, only its survivors
    can pass (the rest have no mass), so only its k values are sorted."""
    candidates = mx.topk(logprobs, top_k, axis=-1) if top_k else logprobs
    ranked = -mx.sort(-candidates, axis=-1)  # likeliest first
    before = mx.cumsum(mx.exp(ranked), axis=-1, inclusive=False)
    admitted = (before < top_p).sum(axis=-1, keepdims=True)  # >= 1: `before` starts at 0
    last = mx.take_along_axis(ranked, admitted - 1, axis=-1)
    return mx.where(logprobs < last, -mx.inf, logprobs)


# What a random number decides, so that one position's decisions never share a key.
TARGET, DRAFT = 0, 1
_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 64-bit hash of the values (splitmix64 steps): cheap, and a pure function."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        h = (h ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h


class RequestRandom:
    """A request's own random stream: seeded requests replay exactly.

    `at(position)` is the stream that decides the token at an absolute position: a pure
    function of the seed, the position and the purpose, however the steps before it fell. A
    request re-prefilled on another pipeline after a node loss (prompt + emitted tokens)
    therefore draws the same numbers as it would have, and continues with the same tokens.
    """

    def __init__(self, seed: int | None):
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        self.seed = seed
        self._key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key

    def at(self, position: int, purpose: int = TARGET) -> RequestRandom:
        return RequestRandom(_mix(self.seed, position, purpose) >> 1)

    def uniform(self, shape: tuple[int, ...] = ()) -> mx.array:
        """Uniform numbers in [0, 1) from the stream's next key."""
        return mx.random.uniform(shape=shape, key=self.next_key())

    def uniform_at(self, positions: range, purpose: int) -> mx.array:
        """One uniform number in [0, 1) per position, [len(positions)]."""
        draws = [
            mx.random.uniform(shape=(1,), key=mx.random.key(_mix(self.seed, p, purpose)))
            for p in positions
        ]
        return draws[0] if len(draws) == 1 else mx.concatenate(draws)


def sample_with(logprobs: mx.array, params: SamplingParams, u: mx.array | None) -> mx.array:
    """One token per row of `logprobs`: argmax when greedy, else drawn with the uniform
    number(s) given, one per row in [0, 1)."""
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    return draw_with(mx.exp(logprobs), u)


def draw(weights: mx.array, rng: RequestRandom) -> mx.array:
    """One index per row, with probability proportional to `weights` (not normalised).

    Inverse-CDF sampling: one uniform number per row rather than Gumbel noise over the whole
    vocabulary, which on a 250k vocabulary is most of a step's sampling cost.
    """
    return draw_with(weights, rng.uniform(weights.shape[:-1]))


def draw_with(weights: mx.array, u: mx.array) -> mx.array:
    """`draw` with the uniform number(s) given: `u` has the shape of `weights` less its last
    axis."""
    cdf = mx.cumsum(weights.astype(mx.float32), axis=-1)
    u = u.reshape(*cdf.shape[:-1], 1) * cdf[..., -1:]
    # The first index whose cumulative weight exceeds u; a zero-weight token is never chosen.
    return mx.minimum((cdf <= u).sum(axis=-1), cdf.shape[-1] - 1)
