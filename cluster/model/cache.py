"""Per-request caches of a shard's layers, with the snapshots that make a draft undoable.

A full-attention layer keeps mlx-lm's `KVCache`: undoing positions is a trim of its offset.
A GatedDeltaNet layer keeps mlx-lm's `ArraysCache` (conv state, recurrent state): its state
folds every position in, so it cannot be trimmed; instead, while a step carries drafts, the
layer records its state after each confirmed prefix (`record_snapshot`) and a rejection
restores the one at the kept length. Snapshots live only until the next step of the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

LayerCache = KVCache | ArraysCache
# A layer's state at a mark: a KV cache's offset, or a GatedDeltaNet layer's (conv, recurrent).
LayerMark = int | tuple[mx.array | None, mx.array | None]


def make_layer_cache(is_linear: bool) -> LayerCache:
    return ArraysCache(size=2) if is_linear else KVCache()


@dataclass(slots=True)
class RequestCache:
    """The caches of one request on one shard (one per layer), and its pending snapshots.

    `snapshots[layer][keep]` is a GatedDeltaNet layer's (conv, recurrent) state after the
    first `keep` positions of the last step. `last_step_len` is how many positions that step
    added, so that a rollback can name what it drops.
    """

    layers: list[LayerCache]
    snapshots: dict[int, dict[int, tuple[mx.array, mx.array]]] = field(default_factory=dict)
    last_step_len: int = 0
    position: int = 0  # positions held in the caches

    @classmethod
    def for_layers(cls, linear_flags: list[bool]) -> RequestCache:
        return cls([make_layer_cache(f) for f in linear_flags])

    def begin_step(self, rollback: int, n_tokens: int) -> None:
        """Apply the previous step's rollback signal, drop its snapshots, expect a new step."""
        if rollback:
            self.rollback(rollback)
        self.snapshots.clear()
        self.last_step_len = n_tokens
        self.position += n_tokens

    def rollback(self, drop: int) -> None:
        """Undo the last `drop` positions of the previous step: restore GDN state, trim KV."""
        if drop == 0:
            return
        if drop > self.last_step_len:
            raise ValueError(
                f"rollback of {drop} positions exceeds the last step's {self.last_step_len}"
            )
        keep = self.last_step_len - drop
        for index, cache in enumerate(self.layers):
            if isinstance(cache, KVCache):
                cache.trim(drop)
                continue
            try:
                cache[0], cache[1] = self.snapshots[index][keep]
            except KeyError:
                raise ValueError(
                    f"no snapshot after position {keep} of the last step in layer {index}"
                ) from None
        self.snapshots.clear()
        self.last_step_len = keep
        self.position -= drop

    def discard(self, drop: int) -> None:
        """Drop the last `drop` positions of attention-only caches (the MTP head's), whatever
        steps added them: the entries that chained drafts wrote, which no verdict confirms."""
        if drop > self.position:
            raise ValueError(f"cannot discard {drop} positions of {self.position}")
        for index, cache in enumerate(self.layers):
            if not isinstance(cache, KVCache):
                raise ValueError(f"layer {index} is recurrent: only a snapshot can undo it")
            cache.trim(drop)
        self.snapshots.clear()
        self.last_step_len = max(self.last_step_len - drop, 0)
        self.position -= drop

    def mark(self) -> CacheMark:
        """What the caches hold now; `restore` undoes every step taken since. Costs no copy:
        MLX arrays are immutable, a step replaces a GatedDeltaNet layer's arrays and writes
        attention keys past the offset that the mark keeps."""
        layers: list[LayerMark] = [
            cache.offset if isinstance(cache, KVCache) else (cache[0], cache[1])
            for cache in self.layers
        ]
        return CacheMark(self.position, self.last_step_len, dict(self.snapshots), tuple(layers))

    def restore(self, mark: CacheMark) -> None:
        for cache, held in zip(self.layers, mark.layers, strict=True):
            if isinstance(cache, KVCache):
                cache.trim(cache.offset - held)
            else:
                cache[0], cache[1] = held
        self.position, self.last_step_len = mark.position, mark.last_step_len
        self.snapshots = dict(mark.snapshots)

    def record_snapshot(self, layer: int, keep: int, conv: mx.array, state: mx.array) -> None:
        self.snapshots.setdefault(layer, {})[keep] = (conv, state)

    @property
    def nbytes(self) -> int:
        total = 0
        for cache in self.layers:
            if isinstance(cache, KVCache):
                total += cache.nbytes if cache.keys is not None else 0
            else:
                total += sum(a.nbytes for a in cache.cache if a is not None)
        return total

    def arrays(self) -> list[mx.array]:
        """Every array the caches hold (to evaluate them together)."""
        out: list[mx.array] = []
        for cache in self.layers:
            if isinstance(cache, KVCache):
                if cache.keys is not None:
                    out += [cache.keys, cache.values]
            else:
                out += [a for a in cache.cache if a is not None]
        return out


@dataclass(frozen=True, slots=True)
class CacheMark:
    """A `RequestCache` at one moment (`RequestCache.mark`)."""

    position: int
    last_step_len: int
    snapshots: dict[int, dict[int, tuple[mx.array, mx.array]]]
    layers: tuple[LayerMark, ...]
