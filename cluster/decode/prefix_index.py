"""The conversation (prefix) cache's index: the token prefixes that every node holds a snapshot of.

The driver of a pipeline (the coordinator, or an in-process engine) owns it. An entry is a
token sequence and the id of the snapshot that each shard keeps of its layers' state after
exactly those tokens (`cluster.decode.snapshots`). A request whose prompt extends an entry's
tokens opens from that snapshot on every shard and prefills only the rest.

An entry exists only while every shard holds its snapshot: the index evicts the least recently
used entries beyond its capacity and has the pipeline drop them on every shard; a shard that
drops one for its own memory budget says so, and the index forgets it and has the others drop
it too. Should a request still meet a shard without the snapshot (a drop still on its way), the
engine falls back to a full prefill, with the same output.

A lookup takes the longest entry that is a token prefix of the prompt and leaves at least one
token to compute (the tail needs that token's logits). Entries at the chat template's message
boundaries (`GenerationRequest.boundaries`) make this robust: a repeat of a prompt, or a next
turn whose text tokenizes differently just after a cut, still finds the last boundary before
the difference. A lookup that finds nothing says why (`MISS_REASONS`), so /metrics can tell a
budget too small from prompts that never repeat.

Token sequences are kept as bytes, 4 a token: a long conversation costs the coordinator 4 bytes
a token per entry (not a tuple of Python ints), and "begins with" is one `bytes.startswith`.
"""

from __future__ import annotations

import secrets
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

DEFAULT_CAPACITY = 64  # entries; each shard also bounds its snapshots' bytes
FORGOTTEN_MEMORY = 1024  # recently dropped ids, so that a late add cannot revive one
# What a lookup that finds no snapshot to start from is counted as (`PrefixStats.misses`):
EVICTED = "evicted"  # a snapshot of a prefix of the prompt was held, and dropped for room
OVER_BUDGET = "over_budget"  # a snapshot of a prefix of the prompt did not fit on a shard
RETOKENIZED = "retokenized"  # an entry matches the prompt up to a few tokens before its end
REPEAT = "repeat"  # an entry covers the whole prompt, with no stored point before its end
NEVER_STORED = "never_stored"  # nothing the index held or dropped begins the prompt
MISS_REASONS = (EVICTED, OVER_BUDGET, RETOKENIZED, REPEAT, NEVER_STORED)
# Re-tokenizing text across a cut changes the tokens next to it: an entry that agrees with
# the prompt up to at most this many tokens before its end (and on at least this many) counts
# as one such miss.
RETOKENIZED_WINDOW = 16
# Dropped prefixes remembered to explain later misses, bounded in count and in bytes (4 a
# token): 32 MiB is about 8M tokens.
DROPPED_MEMORY = 256
DROPPED_MEMORY_BYTES = 32 << 20


def token_key(tokens: Sequence[int]) -> bytes:
    """Token ids as 4-byte words (ids are < 2**31): a prefix of tokens is a prefix of bytes."""
    return array("i", tokens).tobytes()


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading tokens two keys share."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    left = np.frombuffer(a, np.int32, n)
    right = np.frombuffer(b, np.int32, n)
    differ = np.flatnonzero(left != right)
    return int(differ[0]) if differ.size else n


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    key: bytes  # token_key of the tokens every shard's snapshot covers
    snapshot_id: int
    mtp: bool  # made by a request drafting with the MTP head: the tail kept the head's cache

    @classmethod
    def of(cls, tokens: Sequence[int], snapshot_id: int, mtp: bool) -> PrefixEntry:
        return cls(token_key(tokens), snapshot_id, mtp)

    @property
    def length(self) -> int:
        """How many tokens the snapshot covers."""
        return len(self.key) // 4

    def serves(self, mtp: bool) -> bool:
        """Whether a request that does (`mtp`) or does not draft can start from it."""
        return self.mtp or not mtp


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """A lookup's answer: the entry to start from, or None and why (one of `MISS_REASONS`)."""

    entry: PrefixEntry | None
    miss: str | None = None


@dataclass(slots=True)
class PrefixStats:
    lookups: int = 0  # requests that asked the index
    hits: int = 0  # requests that started from a snapshot
    cached_tokens: int = 0  # prompt tokens those requests did not prefill
    fallbacks: int = 0  # hits that met a shard without the snapshot and prefilled it all
    # Requests that prefilled their whole prompt, by reason (`MISS_REASONS`); a fallback
    # counts as `evicted`.
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))


class PrefixPipeline(Protocol):
    """What the prefix cache needs of a pipeline besides steps (`cluster.decode.pipeline`)."""

    on_prefix_dropped: Callable[[list[int]], None] | None

    async def release_as_prefix(
        self, request_id: str, snapshot_id: int, positions: int
    ) -> bool: ...

    async def drop_prefixes(self, snapshot_ids: Iterable[int]) -> None: ...


class PrefixIndex:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"the prefix index needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.stats = PrefixStats()
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._key_of: dict[int, bytes] = {}
        self._forgotten: deque[int] = deque(maxlen=FORGOTTEN_MEMORY)
        # Keys no longer indexed, with why they went (EVICTED or OVER_BUDGET), oldest first.
        self._dropped: OrderedDict[bytes, tuple[bool, str]] = OrderedDict()
        self._dropped_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def new_id() -> int:
        """A snapshot id no other driver of the same nodes will pick (63 random bits, not 0)."""
        return secrets.randbits(63) | 1

    def holds(self, tokens: Sequence[int], mtp: bool) -> bool:
        """Whether an entry for exactly `tokens` serves a request that does (`mtp`) or does
        not draft."""
        entry = self._entries.get(token_key(tokens))
        return entry is not None and entry.serves(mtp)

    def longest(self, prompt: Sequence[int], mtp: bool) -> PrefixEntry | None:
        """`lookup(prompt, mtp).entry`."""
        return self.lookup(prompt, mtp).entry

    def lookup(self, prompt: Sequence[int], mtp: bool) -> PrefixLookup:
        """The longest entry whose tokens begin `prompt` and leave at least one token to
        compute, usable by a request that does (`mtp`) or does not draft; now the most
        recently used. Without one, the miss is counted by its reason."""
        self.stats.lookups += 1
        wanted = token_key(prompt)
        best: PrefixEntry | None = None
        for key, entry in self._entries.items():
            if len(key) >= len(wanted) or not entry.serves(mtp):
                continue
            if (best is None or len(key) > len(best.key)) and wanted.startswith(key):
                best = entry
        if best is not None:
            self._entries.move_to_end(best.key)
            return PrefixLookup(best)
        reason = self._why_missed(wanted, mtp)
        self.stats.misses[reason] += 1
        return PrefixLookup(None, reason)

    def _why_missed(self, wanted: bytes, mtp: bool) -> str:
        for key, (entry_mtp, reason) in reversed(self._dropped.items()):
            if len(key) < len(wanted) and (entry_mtp or not mtp) and wanted.startswith(key):
                return reason
        reason = NEVER_STORED
        for key, entry in self._entries.items():
            if not entry.serves(mtp):
                continue
            shared = common_prefix(key, wanted)
            if shared == len(wanted) // 4:
                return REPEAT  # the prompt is all inside this entry
            if shared >= max(len(key) // 4 - RETOKENIZED_WINDOW, RETOKENIZED_WINDOW):
                reason = RETOKENIZED
        return reason

    def add(self, entry: PrefixEntry) -> list[int]:
        """Index a snapshot that every shard now holds. Returns the snapshot ids to drop on
        every shard: the least recently used beyond capacity, an entry it replaces, or the new
        one itself if a shard dropped it meanwhile (it did not fit there)."""
        if entry.snapshot_id in self._forgotten:
            self._remember_dropped(entry, OVER_BUDGET)
            return [entry.snapshot_id]
        dropped = []
        old = self._entries.pop(entry.key, None)
        if old is not None:
            del self._key_of[old.snapshot_id]
            dropped.append(old.snapshot_id)
        self._unremember(entry.key)
        self._entries[entry.key] = entry
        self._key_of[entry.snapshot_id] = entry.key
        while len(self._entries) > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            del self._key_of[evicted.snapshot_id]
            self._remember_dropped(evicted, EVICTED)
            dropped.append(evicted.snapshot_id)
        return dropped

    def not_stored(self, tokens: Sequence[int], mtp: bool) -> None:
        """A snapshot of `tokens` was asked for and some shard could not keep it."""
        self._remember_dropped(PrefixEntry.of(tokens, 0, mtp), OVER_BUDGET)

    def forget(self, snapshot_ids: Iterable[int]) -> None:
        """Snapshots that some shard no longer holds. A shard drops its least recently used
        snapshot for room, so one that drops the entry added last could not fit it at all."""
        for snapshot_id in snapshot_ids:
            self._forgotten.append(snapshot_id)
            key = self._key_of.pop(snapshot_id, None)
            if key is not None:
                newest = next(reversed(self._entries)) == key
                entry = self._entries.pop(key)
                self._remember_dropped(entry, OVER_BUDGET if newest else EVICTED)

    def clear(self) -> None:
        """A new pipeline: its shards hold no snapshots."""
        for entry in self._entries.values():
            self._remember_dropped(entry, EVICTED)
        self._entries.clear()
        self._key_of.clear()

    def _remember_dropped(self, entry: PrefixEntry, reason: str) -> None:
        self._unremember(entry.key)
        self._dropped[entry.key] = (entry.mtp, reason)
        self._dropped_bytes += len(entry.key)
        while self._dropped and (
            len(self._dropped) > DROPPED_MEMORY or self._dropped_bytes > DROPPED_MEMORY_BYTES
        ):
            key, _ = self._dropped.popitem(last=False)
            self._dropped_bytes -= len(key)

    def _unremember(self, key: bytes) -> None:
        if self._dropped.pop(key, None) is not None:
            self._dropped_bytes -= len(key)
