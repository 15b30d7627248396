"""Constrained decoding: which tokens may come next, decided by the driver, obeyed by the tail.

The driver (the engine) holds a `TokenConstraint`, e.g. a JSON schema's grammar, and sends with
each step one bitmask per position the tail samples: after the step's confirmed tokens, then
after each MTP draft as if it were accepted. The tail sets the logits of the other tokens to
-inf before sampling and verifying, so a draft that breaks the grammar has no probability under
the target and is rejected like any wrong draft; the correction comes from the allowed tokens.
The masks are bits (bit t = token t, little-endian), 1/8 of a byte per vocabulary entry.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np


class TokenConstraint(Protocol):
    """A request's constraint as generation goes on."""

    def masks(self, drafts: tuple[int, ...]) -> tuple[bytes, ...]:
        """The allowed tokens now, then after each prefix of `drafts` (1 + len(drafts))."""
        ...

    def advance(self, tokens: tuple[int, ...]) -> None:
        """Take in emitted tokens (all allowed by the masks they were sampled under)."""
        ...


def allowed_tokens(masks: tuple[bytes, ...], vocab: int) -> mx.array:
    """[len(masks), vocab] booleans; tokens past a mask's end (padding rows) are not allowed."""
    bits = np.zeros((len(masks), vocab), dtype=bool)
    for row, mask in enumerate(masks):
        unpacked = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        n = min(vocab, unpacked.size)
        bits[row, :n] = unpacked[:n].astype(bool)
    return mx.array(bits)


def constrain(logits: mx.array, masks: tuple[bytes, ...]) -> mx.array:
    """`logits` [rows, vocab] with the tokens the masks forbid at -inf (no masks: as is)."""
    if not masks:
        return logits
    return mx.where(allowed_tokens(masks, logits.shape[-1]), logits, -mx.inf)
