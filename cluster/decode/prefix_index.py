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

Token sequences are kept as bytes, 4 a token: a long conversation costs the coordinator 4 bytes
a token per entry (not a tuple of Python ints), and "begins with" is one `bytes.startswith`.
"""

from __future__ import annotations

import secrets
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_CAPACITY = 64  # entries; each shard also bounds its snapshots' bytes
FORGOTTEN_MEMORY = 1024  # recently dropped ids, so that a late add cannot revive one


def token_key(tokens: Sequence[int]) -> bytes:
    """Token ids as 4-byte words (ids are < 2**31): a prefix of tokens is a prefix of bytes."""
    return array("i", tokens).tobytes()


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


@dataclass(slots=True)
class PrefixStats:
    lookups: int = 0  # requests that asked the index
    hits: int = 0  # requests that started from a snapshot
    cached_tokens: int = 0  # prompt tokens those requests did not prefill
    fallbacks: int = 0  # hits that met a shard without the snapshot and prefilled it all


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
        return entry is not None and (entry.mtp or not mtp)

    def longest(self, prompt: Sequence[int], mtp: bool) -> PrefixEntry | None:
        """The longest entry whose tokens begin `prompt` and leave at least one token to
        compute, usable by a request that does (`mtp`) or does not draft; now the most
        recently used."""
        self.stats.lookups += 1
        wanted = token_key(prompt)
        best: PrefixEntry | None = None
        for key, entry in self._entries.items():
            if len(key) >= len(wanted) or (mtp and not entry.mtp):
                continue
            if (best is None or len(key) > len(best.key)) and wanted.startswith(key):
                best = entry
        if best is not None:
            self._entries.move_to_end(best.key)
        return best

    def add(self, entry: PrefixEntry) -> list[int]:
        """Index a snapshot that every shard now holds. Returns the snapshot ids to drop on
        every shard: the least recently used beyond capacity, an entry it replaces, or the new
        one itself if a shard dropped it meanwhile."""
        if entry.snapshot_id in self._forgotten:
            return [entry.snapshot_id]
        dropped = []
        old = self._entries.pop(entry.key, None)
        if old is not None:
            del self._key_of[old.snapshot_id]
            dropped.append(old.snapshot_id)
        self._entries[entry.key] = entry
        self._key_of[entry.snapshot_id] = entry.key
        while len(self._entries) > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            del self._key_of[evicted.snapshot_id]
            dropped.append(evicted.snapshot_id)
        return dropped

    def forget(self, snapshot_ids: Iterable[int]) -> None:
        """Snapshots that some shard no longer holds."""
        for snapshot_id in snapshot_ids:
            self._forgotten.append(snapshot_id)
            key = self._key_of.pop(snapshot_id, None)
            if key is not None:
                del self._entries[key]

    def clear(self) -> None:
        """A new pipeline: its shards hold no snapshots."""
        self._entries.clear()
        self._key_of.clear()
