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

    Greedy requests get the plain softmax (their logprobs, if asked for)."""
    logits = logits.astype(mx.float32)
    if params.greedy:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = mx.argsort(-logprobs, axis=-1)
        sorted_probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
        # Keep a token while the mass before it is below top_p (the first always stays).
        before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < params.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        logprobs = mx.where(keep, logprobs, -mx.inf)
    if params.min_p > 0.0:
        top = mx.max(logprobs, axis=-1, keepdims=True)
        logprobs = mx.where(logprobs < top + mx.log(mx.array(params.min_p)), -mx.inf, logprobs)
    if params.top_p < 1.0 or params.min_p > 0.0:
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    return logprobs


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

    def uniform_at(self, positions: range, purpose: int) -> mx.array:
        """One uniform number in [0, 1) per position, [len(positions)]."""
        draws = [
            mx.random.uniform(shape=(1,), key=mx.random.key(_mix(self.seed, p, purpose)))
            for p in positions
        ]
        return draws[0] if len(draws) == 1 else mx.concatenate(draws)


def sample(logprobs: mx.array, params: SamplingParams, rng: RequestRandom) -> mx.array:
    """One token per row of `logprobs` (argmax when greedy)."""
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    return draw(mx.exp(logprobs), rng)


def sample_with(logprobs: mx.array, params: SamplingParams, u: mx.array | None) -> mx.array:
    """`sample` with the uniform number(s) given: one per row, in [0, 1) (None if greedy)."""
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    return draw_with(mx.exp(logprobs), u)


def draw(weights: mx.array, rng: RequestRandom) -> mx.array:
    """One index per row, with probability proportional to `weights` (not normalised).

    Inverse-CDF sampling: one uniform number per row rather than Gumbel noise over the whole
    vocabulary, which on a 250k vocabulary is most of a step's sampling cost.
    """
    return draw_with(weights, mx.random.uniform(shape=weights.shape[:-1], key=rng.next_key()))


def draw_with(weights: mx.array, u: mx.array) -> mx.array:
    """`draw` with the uniform number(s) given: `u` has the shape of `weights` less its last
    axis."""
    cdf = mx.cumsum(weights.astype(mx.float32), axis=-1)
    u = u.reshape(*cdf.shape[:-1], 1) * cdf[..., -1:]
    # The first index whose cumulative weight exceeds u; a zero-weight token is never chosen.
    return mx.minimum((cdf <= u).sum(axis=-1), cdf.shape[-1] - 1)
