"""Attention caches whose keys and values may be rows of one batch's buffer (a slab).

A batch step whose requests' steps have one length (every decode step, typically) writes all
their new keys with one scatter per layer and attends over them with one call, each row masked
to its own positions, instead of a write and an attention call per request and layer: on a GPU,
where a decode step's per-request work is kernel launches rather than arithmetic, that is what
a batch of 8 costs over one request.

Each request keeps its row of the slab and its own offset (`SlabRowCache`, mlx-lm's `KVCache`
otherwise): position p of a request is slot p of its row, so rolling back a rejected draft is
still a trim of that request's offset alone, and nothing moves. The slab is made when at most
`MAX_ROWS` requests step together for the second time in a row (`KVSlab.steady`), their keys
copied in once (`KVSlab.of`), and kept while the same requests step in the same order. A
request that steps on its own (a prefill chunk, a step of another length) writes into its row
in place, and takes its row out as its own once the slab has no room left for it. A slab row
is as long as the batch's longest request: what a batch costs in memory beyond its requests'
own caches, as in mlx-lm's batch caches.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models.cache import KVCache

ALLOCATION_STEP = KVCache.step  # positions are allocated in blocks of this many, as mlx-lm does
# Larger batches attend request by request: a slab's buffers grow with its rows, and MLX's
# allocator keeps freed buffers of every size it saw (1000 short requests in one batch took a
# test process to 24 GB).
MAX_ROWS = 32


def _capacity(end: int) -> int:
    return -(-end // ALLOCATION_STEP) * ALLOCATION_STEP


def _zeros_like_step(step: mx.array, positions: int, rows: int = 1) -> mx.array:
    """Zeros shaped like a [*, heads, *, dim] step's keys (or values), for `positions`."""
    return mx.zeros((rows, step.shape[1], positions, step.shape[3]), step.dtype)


class KVSlab:
    """One attention layer's keys and values of a batch's requests: [rows, heads, capacity, dim]."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values

    @property
    def rows(self) -> int:
        return self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @staticmethod
    def steady(caches: list[SlabRowCache]) -> bool:
        """Whether `caches`, at most `MAX_ROWS` of them, stepped together in this order in their
        last step (or are a slab's rows in order): only then is a slab made for them. Where
        requests come and go at every step (many short requests), a slab per step would copy
        every request's keys each time."""
        if len(caches) > MAX_ROWS:
            return False
        batch = tuple(id(c) for c in caches)
        steady = all(c.last_batch == batch for c in caches)
        for cache in caches:
            cache.last_batch = batch
        return steady or (caches[0].slab is not None and caches[0].slab.holds(caches))

    def holds(self, caches: list[SlabRowCache]) -> bool:
        """Whether `caches` are this slab's rows, in order."""
        return self.rows == len(caches) and all(
            c.slab is self and c.row == i for i, c in enumerate(caches)
        )

    @classmethod
    def of(cls, caches: list[SlabRowCache], keys: mx.array, values: mx.array) -> KVSlab:
        """The slab whose row i is `caches[i]`, with room for the step `keys` and `values`
        [rows, heads, length, dim]: the one the caches share if they are its rows in order,
        else a new one their keys are copied into (each cache becomes its row)."""
        end = max(c.offset for c in caches) + keys.shape[2]
        slab = caches[0].slab
        if slab is not None and slab.holds(caches):
            slab.reserve(end)
            return slab
        capacity = _capacity(end)
        held = [c.held(capacity, keys, values) for c in caches]
        slab = cls(*(mx.concatenate([h[i] for h in held], axis=0) for i in (0, 1)))
        for row, cache in enumerate(caches):
            cache.join(slab, row)
        return slab

    def reserve(self, end: int) -> None:
        """Room for positions up to `end` in every row (grown for all rows at once)."""
        if end <= self.capacity:
            return
        more = _capacity(end) - self.capacity
        self.keys, self.values = (
            mx.concatenate([a, _zeros_like_step(a, more, a.shape[0])], axis=2)
            for a in (self.keys, self.values)
        )

    def write(
        self, keys: mx.array, values: mx.array, offsets: tuple[int, ...]
    ) -> tuple[mx.array, mx.array]:
        """Write a step's keys and values [rows, heads, length, dim], row i from position
        `offsets[i]` on, and return the slab up to the longest row's new end."""
        length = keys.shape[2]
        end = max(offsets) + length
        if min(offsets) == max(offsets):  # one slice for all rows
            start = offsets[0]
            self.keys[:, :, start:end, :] = keys
            self.values[:, :, start:end, :] = values
        else:
            where = _positions(offsets, length)
            self.keys = mx.put_along_axis(self.keys, where, keys, axis=2)
            self.values = mx.put_along_axis(self.values, where, values, axis=2)
        if end == self.capacity:
            return self.keys, self.values
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]


@functools.lru_cache(maxsize=16)
def _positions(offsets: tuple[int, ...], length: int) -> mx.array:
    """[rows, 1, length, 1]: where each row's step goes, made once per step for all layers."""
    at = mx.array(offsets)[:, None] + mx.arange(length)[None]
    return at[:, None, :, None]


@functools.lru_cache(maxsize=16)
def visible(offsets: tuple[int, ...], length: int) -> mx.array:
    """[rows, 1, length, end]: the keys each query of a step sees, row i's step standing at
    `offsets[i]` of its own row (causal, and nothing past the row's end). Made once per step
    for all layers."""
    keys = mx.arange(max(offsets) + length)
    queries = mx.array(offsets)[:, None] + mx.arange(length)[None]
    return (keys[None, None, :] <= queries[:, :, None])[:, None]


class SlabRowCache(KVCache):
    """mlx-lm's `KVCache` whose keys and values are its own or row `row` of a `KVSlab`.
    `keys` and `values` read the row (a view); writes go to the storage they belong to."""

    def __init__(self) -> None:
        self.slab: KVSlab | None = None
        self.row = 0
        self.last_batch: tuple[int, ...] = ()  # the caches it last stepped with (`steady`)
        super().__init__()

    @property
    def keys(self) -> mx.array | None:
        return self._keys if self.slab is None else self.slab.keys[self.row : self.row + 1]

    @keys.setter
    def keys(self, keys: mx.array | None) -> None:
        self.slab, self._keys = None, keys

    @property
    def values(self) -> mx.array | None:
        return self._values if self.slab is None else self.slab.values[self.row : self.row + 1]

    @values.setter
    def values(self, values: mx.array | None) -> None:
        self.slab, self._values = None, values

    def join(self, slab: KVSlab, row: int) -> None:
        """Hold row `row` of `slab` from now on (what it held is in that row already)."""
        self._keys = self._values = None
        self.slab, self.row = slab, row

    def held(self, capacity: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The positions held, as [1, heads, capacity, dim] keys and values: zeros beyond
        them, and zeros shaped like a step's `keys` and `values` where none is held yet."""
        if self.offset == 0 or self.keys is None:
            return _zeros_like_step(keys, capacity), _zeros_like_step(values, capacity)
        out = []
        for held in (self.keys, self.values):
            held = held[:, :, : min(self.offset, capacity), :]
            if (pad := capacity - held.shape[2]) > 0:
                held = mx.concatenate([held, _zeros_like_step(held, pad)], axis=2)
            out.append(held)
        return out[0], out[1]

    def write(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Keys and values [1, heads, n, dim] at positions `start`.. of this request, in
        place in the storage they belong to (which must have room)."""
        end = start + keys.shape[2]
        if self.slab is None:
            self._keys[..., start:end, :] = keys
            self._values[..., start:end, :] = values
        else:
            self.slab.keys[self.row : self.row + 1, :, start:end, :] = keys
            self.slab.values[self.row : self.row + 1, :, start:end, :] = values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """A step of this request alone: in its row where there is room. Where there is none
        it takes its row out as its own and grows that (mlx-lm's way): a request stepping
        alone never grows a batch's slab, whose other rows may be long gone."""
        if self.slab is not None and self.offset + keys.shape[2] > self.slab.capacity:
            row = slice(self.row, self.row + 1)
            held = [a[row, :, : self.offset, :] for a in (self.slab.keys, self.slab.values)]
            self.keys, self.values = held  # views: the growth in mlx-lm's call copies them out
        if self.slab is None:
            return super().update_and_fetch(keys, values)
        start = self.offset
        self.offset += keys.shape[2]
        self.write(start, keys, values)
        return self.keys_and_values()

    @property
    def nbytes(self) -> int:
        if self.slab is None:
            return super().nbytes
        return self.slab.nbytes // self.slab.rows
