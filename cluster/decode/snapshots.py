"""A shard's prefix snapshots: the conversation cache's share that lives on one node.

At the end of a prompt, at a message boundary inside it (the end of a prefill chunk that the
driver cut there), or at the end of an answer, the driver may ask each node to keep its layers'
state at that point: attention KV up to there, and the GatedDeltaNet conv and recurrent states,
which fold every position in and cannot be trimmed back, so a reuse point must be an exact
snapshot. Its memory is the KV of its positions (growing with them) plus one GatedDeltaNet state
per layer (the same at any length), `CacheSnapshot.kv_nbytes` and `state_nbytes`.
A later request that extends the same tokens opens from the snapshot and computes only the
rest. On the tail the MTP head's cache comes along: its pairs before the snapshot's last
position, and the MTP input at that position, whose pair waits for the next request's token.

Snapshots are immutable: a request opened from one gets caches of its own whose first write
allocates new arrays (mlx-lm's `KVCache` grows by concatenation when full, and a restored
cache is exactly full), so any number of requests may share one snapshot. The store evicts
least recently used snapshots to stay under its byte budget and says which it dropped, so that
the driver, which owns the index of prefixes, drops them on every node.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from cluster.decode.tail import Tail, TailRequest
from cluster.messages import RequestError, RequestOptions
from cluster.model.cache import RequestCache

DEFAULT_PREFIX_BUDGET_BYTES = 1 << 30


class PrefixSnapshotMissing(RequestError):
    """A step asked to open from a prefix snapshot that this shard does not hold."""


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """One request's layer caches at `position` positions: per layer (keys, values) for
    attention (None before any position), (conv, recurrent) for GatedDeltaNet."""

    position: int
    linear: tuple[bool, ...]
    arrays: tuple[tuple[mx.array, mx.array] | None, ...]

    @classmethod
    def take(cls, cache: RequestCache, positions: int) -> CacheSnapshot:
        """The first `positions` positions of `cache` (all of them where it has a
        GatedDeltaNet layer: that state cannot be cut), copied out of its growing buffers."""
        linear = tuple(isinstance(layer, ArraysCache) for layer in cache.layers)
        if any(linear) and positions != cache.position:
            raise ValueError(f"a snapshot at {positions} of caches at {cache.position}")
        if not 0 <= positions <= cache.position:
            raise ValueError(f"a snapshot at {positions} of caches at {cache.position}")
        arrays: list[tuple[mx.array, mx.array] | None] = []
        for index, layer in enumerate(cache.layers):
            if isinstance(layer, KVCache):
                if positions == 0 or layer.keys is None:
                    arrays.append(None)
                    continue
                arrays.append(
                    (
                        mx.contiguous(layer.keys[..., :positions, :]),
                        mx.contiguous(layer.values[..., :positions, :]),
                    )
                )
            else:
                arrays.append(cache.linear_state(index))
        snapshot = cls(positions, linear, tuple(arrays))
        mx.eval([a for pair in arrays if pair is not None for a in pair])
        return snapshot

    def restore(self) -> RequestCache:
        """Fresh caches holding the snapshot's positions (sharing its arrays, never writing
        into them)."""
        cache = RequestCache.for_layers(list(self.linear))
        for layer, pair in zip(cache.layers, self.arrays, strict=True):
            if pair is None:
                continue
            if isinstance(layer, KVCache):
                layer.keys, layer.values = pair
                layer.offset = self.position
            else:
                layer[0], layer[1] = pair
        cache.position = self.position
        return cache

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.state_nbytes

    @property
    def kv_nbytes(self) -> int:
        """The attention layers' share: grows with `position`."""
        return sum(
            a.nbytes
            for linear, pair in zip(self.linear, self.arrays, strict=True)
            if pair is not None and not linear
            for a in pair
        )

    @property
    def state_nbytes(self) -> int:
        """The GatedDeltaNet layers' share: the same at any `position`."""
        return sum(
            a.nbytes
            for linear, pair in zip(self.linear, self.arrays, strict=True)
            if pair is not None and linear
            for a in pair
            if a is not None
        )


@dataclass(frozen=True, slots=True)
class TailSnapshot:
    """The MTP head's share at a snapshot of P positions: its pairs for positions 0..P-2 and
    the MTP input at P-1 (`pending_hidden`), whose token is the next request's own."""

    mtp: CacheSnapshot | None
    pending_hidden: mx.array | None

    @classmethod
    def take(cls, state: TailRequest, positions: int) -> TailSnapshot:
        """After a sampled step (the prompt's last chunk, a decode step) the MTP input at
        `positions - 1` is among the step's recent inputs; after a prefill chunk that is not
        the prompt's last (a message boundary), it is the input still waiting for its token."""
        if state.mtp_cache is None:
            return cls(None, None)
        if state.pending_hidden is not None:
            if state.mtp_cache.position != positions - 1:
                raise ValueError(f"the tail's MTP input waits at {state.mtp_cache.position}")
            pending = mx.contiguous(state.pending_hidden)  # not a view of the chunk's rows
        else:
            row = positions - 1 - state.recent_start
            recent = state.recent_inputs
            if recent is None or not 0 <= row < recent.shape[1]:
                raise ValueError(f"the tail kept no MTP input for position {positions - 1}")
            pending = mx.contiguous(recent[:, row : row + 1])
        mx.eval(pending)
        return cls(CacheSnapshot.take(state.mtp_cache, positions - 1), pending)

    def open(self, tail: Tail, options: RequestOptions | None) -> TailRequest:
        """A new request's tail state, continuing from the snapshot."""
        state = tail.open(options)
        if state.mtp_cache is not None:  # the request drafts with the MTP head
            if self.mtp is None:
                raise PrefixSnapshotMissing("the prefix snapshot holds no MTP head state")
            state.mtp_cache = self.mtp.restore()
            state.pending_hidden = self.pending_hidden
        return state

    @property
    def nbytes(self) -> int:
        mtp = self.mtp.nbytes if self.mtp else 0
        return mtp + (self.pending_hidden.nbytes if self.pending_hidden is not None else 0)


@dataclass(frozen=True, slots=True)
class PrefixSnapshot:
    cache: CacheSnapshot
    tail: TailSnapshot | None

    @property
    def position(self) -> int:
        return self.cache.position

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + (self.tail.nbytes if self.tail else 0)

    @classmethod
    def take(cls, cache: RequestCache, tail: TailRequest | None, positions: int) -> PrefixSnapshot:
        """The state after `positions` positions; the request's caches must hold exactly
        those (apply its pending rollback first)."""
        tail_snapshot = TailSnapshot.take(tail, positions) if tail is not None else None
        return cls(CacheSnapshot.take(cache, positions), tail_snapshot)


class SnapshotStore:
    """Prefix snapshots by id, least recently used first, within a byte budget."""

    def __init__(self, budget_bytes: int | None = DEFAULT_PREFIX_BUDGET_BYTES):
        self.budget_bytes = DEFAULT_PREFIX_BUDGET_BYTES if budget_bytes is None else budget_bytes
        self._snapshots: OrderedDict[int, PrefixSnapshot] = OrderedDict()
        self.nbytes = 0
        self.resumes = 0

    def __len__(self) -> int:
        return len(self._snapshots)

    def __contains__(self, snapshot_id: int) -> bool:
        return snapshot_id in self._snapshots

    def put(self, snapshot_id: int, snapshot: PrefixSnapshot) -> list[int]:
        """Keep `snapshot`, evicting the least recently used ones for room. Returns the ids
        no longer held: the evicted ones, and `snapshot_id` itself if it cannot fit."""
        self.drop([snapshot_id])  # a snapshot taken again replaces the old one
        dropped: list[int] = []
        size = snapshot.nbytes
        if size > self.budget_bytes:
            return [snapshot_id]
        while self.nbytes + size > self.budget_bytes:
            oldest, evicted = self._snapshots.popitem(last=False)
            self.nbytes -= evicted.nbytes
            dropped.append(oldest)
        self._snapshots[snapshot_id] = snapshot
        self.nbytes += size
        return dropped

    def get(self, snapshot_id: int) -> PrefixSnapshot:
        """The snapshot, now the most recently used; `PrefixSnapshotMissing` if not held."""
        snapshot = self._snapshots.get(snapshot_id)
        if snapshot is None:
            raise PrefixSnapshotMissing(f"prefix snapshot {snapshot_id} is not held")
        self._snapshots.move_to_end(snapshot_id)
        self.resumes += 1
        return snapshot

    def drop(self, snapshot_ids: list[int]) -> list[int]:
        """Forget these snapshots; returns the ids that were held."""
        dropped = []
        for snapshot_id in snapshot_ids:
            snapshot = self._snapshots.pop(snapshot_id, None)
            if snapshot is not None:
                self.nbytes -= snapshot.nbytes
                dropped.append(snapshot_id)
        return dropped

    def clear(self) -> None:
        self._snapshots.clear()
        self.nbytes = 0
