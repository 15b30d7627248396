"""Per-request caches of a shard's layers, with the snapshots that make a draft undoable.

A full-attention layer keeps mlx-lm's `KVCache` (as `SlabRowCache`, whose keys may be a row of
a batch's buffer: cluster.model.kv_slab): undoing positions is a trim of its offset.
A GatedDeltaNet layer keeps mlx-lm's `ArraysCache` (conv state, recurrent state): its state
folds every position in, so it cannot be trimmed; instead, while a step carries drafts, the
layer records its state after each confirmed prefix (`record_snapshot`) and a rejection
restores the one at the kept length. Snapshots live only until the next step of the request.

A batch step computes the GatedDeltaNet states of all its requests as one `[B, ...]` array.
Each request keeps its row of it as a `BatchRow`, not sliced out: the batch's next step, when it
holds the same requests in the same order, takes the batch's array as it is (`stack_rows`), so a
steady batch pays no per-request gather and scatter in each layer and step.

A step built before the verdict of the step before it is read (`cluster.decode.runner`, steps
built ahead) finds the caches holding every position of that step, drafts included, and a
`PendingVerdicts` of how many drafts each request kept, on the device. `defer_verdicts` applies it
there: a GatedDeltaNet layer takes the state the verdict picks (one `mx.where` per state for
the batch); an attention cache keeps the rejected drafts' keys as a hole that the new step's
attention masks out (its positions move back by the drop, `PendingVerdicts.offsets`). Once the host
reads the verdict, `RequestCache.resolve` closes the hole: the new step's keys move down over
it. A step built ahead and not asked for is still undone by a `mark` and `restore`: before the
verdict is read nothing is written below the positions the caches held, and after it only the
rejected drafts' slots are, which the rollback that the verdict implies drops anyway.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from cluster.model.kv_slab import SlabRowCache, visible


@dataclass(frozen=True, slots=True)
class BatchRow:
    """Row `row` of a state that a batch step computed for all its requests at once."""

    batch: mx.array
    row: int

    def array(self) -> mx.array:
        return self.batch[self.row : self.row + 1]

    @property
    def nbytes(self) -> int:
        return self.batch.nbytes // self.batch.shape[0]


# A GatedDeltaNet layer's conv or recurrent state: its own [1, ...] array or a batch's row.
RowState = mx.array | BatchRow
LayerCache = KVCache | ArraysCache
# A layer's state at a mark: a KV cache's offset, or a GatedDeltaNet layer's (conv, recurrent).
LayerMark = int | tuple[RowState | None, RowState | None]


def own(state: RowState) -> mx.array:
    """The request's state as an array of its own ([1, ...])."""
    return state.array() if isinstance(state, BatchRow) else state


def batch_rows(batch: mx.array) -> list[RowState]:
    """Each request's share of a batch step's state `batch` ([B, ...]), not sliced out."""
    if batch.shape[0] == 1:
        return [batch]
    return [BatchRow(batch, row) for row in range(batch.shape[0])]


def stack_rows(states: list[RowState | None], shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """Requests' states stacked along the batch axis (zeros for a request's first step).

    Where request i holds row i of batch arrays that all have one row per request, the stack
    is those arrays themselves: one of them as it is (a batch that steps again unchanged), or
    merged row by row with `mx.where` (a batch some of whose requests restored a snapshot
    after a rejected draft). Anything else is gathered and concatenated.
    """
    size = len(states)
    if size == 1:
        return mx.zeros(shape, dtype=dtype) if states[0] is None else own(states[0])
    sources: dict[int, mx.array] = {}
    if all(
        isinstance(s, BatchRow) and s.row == i and s.batch.shape[0] == size
        for i, s in enumerate(states)
    ):
        rows_of: dict[int, list[bool]] = {}
        for i, s in enumerate(states):
            sources.setdefault(id(s.batch), s.batch)
            rows_of.setdefault(id(s.batch), [False] * size)[i] = True
        if len(sources) <= MAX_MERGED_SOURCES:
            ids = sorted(sources, key=lambda k: -sum(rows_of[k]))  # the most rows first
            merged = sources[ids[0]]
            for key in ids[1:]:
                merged = mx.where(_row_mask(tuple(rows_of[key]), merged.ndim), sources[key], merged)
            return merged
    filled = [mx.zeros(shape, dtype=dtype) if s is None else own(s) for s in states]
    return mx.concatenate(filled, axis=0)


def _detached(state: RowState | None) -> mx.array | None:
    if not isinstance(state, BatchRow):
        return state
    # A row of a row-major batch is contiguous, so `mx.contiguous` would share the batch's
    # buffer; multiplying by one copies it, exactly (-0.0, inf and NaN included).
    return state.array() * 1


MAX_MERGED_SOURCES = 4  # beyond this many sources, gathering rows costs fewer ops than merging


@functools.lru_cache(maxsize=256)
def _row_mask(rows: tuple[bool, ...], ndim: int) -> mx.array:
    """A [B, 1, ...] mask of `rows`, made once: the same pattern recurs in every layer."""
    return mx.array(rows).reshape(len(rows), *([1] * (ndim - 1)))


class PendingVerdicts:
    """How many drafts each request of a step kept, on the device, for the step built after it
    before the host has read them. Row i is request i of that step; `undecided[i]` its drafts
    (the verdict keeps 0 to all of them). The masks and offsets derived from it are made once
    per step and shared by all layers."""

    def __init__(self, accepted: list[mx.array | None], undecided: list[int]):
        self.undecided = tuple(undecided)
        kept = mx.stack([mx.array(0, mx.uint32) if a is None else a for a in accepted])
        # Positions of each request's last step that the verdict drops.
        self.drop = mx.array(self.undecided, mx.int32) - kept.astype(mx.int32)
        self._made: dict[tuple, mx.array] = {}

    def _memo(self, key: tuple, make) -> mx.array:
        if (made := self._made.get(key)) is None:
            made = self._made[key] = make()
        return made

    def drops(self, rows: tuple[int, ...]) -> mx.array:
        """[len(rows)]: the drop of each of `rows` (all of them in order: `drop` as it is)."""
        if rows == tuple(range(len(self.undecided))):
            return self.drop
        return self._memo(("drops", rows), lambda: self.drop[mx.array(rows)])

    def keeps(self, rows: tuple[int, ...], drafts: int, ndim: int) -> mx.array:
        """[len(rows), 1, ...]: whether each of `rows` kept `drafts` drafts."""
        return self._memo(
            ("keeps", rows, drafts, ndim),
            lambda: (self.drops(rows) == self.undecided[rows[0]] - drafts).reshape(
                len(rows), *([1] * (ndim - 1))
            ),
        )

    def offsets(self, rows: tuple[int, ...], held: tuple[int, ...]) -> mx.array:
        """[len(rows)]: where the next positions of `rows` stand, whose caches hold `held`."""
        return self._memo(("offsets", rows, held), lambda: mx.array(held) - self.drops(rows))

    def mask(self, row: int, hole_end: int, length: int) -> mx.array:
        """[length, hole_end + length]: which keys each of a step's `length` positions sees,
        its request's cache having held `hole_end` positions before it: all but the hole of
        the rejected drafts before `hole_end`, and its own step causally."""

        def make() -> mx.array:
            keys = mx.arange(hole_end + length)[None]
            queries = mx.arange(length)[:, None]
            before_hole = keys < hole_end - self.drop[row]
            return before_hole | ((keys >= hole_end) & (keys <= hole_end + queries))

        return self._memo(("mask", row, hole_end, length), make)

    def visible(
        self, rows: tuple[int, ...], hole_ends: tuple[int, ...], held: tuple[int, ...], length: int
    ) -> mx.array:
        """[len(rows), 1, length, end]: `kv_slab.visible` for a step whose requests' rows of a
        slab stand at `held`, less each row's hole of rejected drafts before `hole_ends`."""

        def make() -> mx.array:
            keys = mx.arange(max(held) + length)[None]
            ends = mx.array(hole_ends)[:, None]
            hole = (keys >= ends - self.drops(rows)[:, None]) & (keys < ends)
            return visible(held, length) & ~hole[:, None, None, :]

        return self._memo(("visible", rows, hole_ends, held, length), make)


@dataclass(frozen=True, slots=True)
class DeferredVerdict:
    """A request's caches waiting for the verdict of its last step: row `row` of `verdicts`.
    `hole_end` is the positions the caches held when it was deferred."""

    verdicts: PendingVerdicts
    row: int
    hole_end: int


def defer_verdicts(caches: list[RequestCache], verdicts: PendingVerdicts, rows: list[int]) -> None:
    """Apply, on the device, each cache's share of `verdicts` (`rows[i]` is cache i's row):
    see the module's docstring. Before the step that follows."""
    by_drafts: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        caches[i].deferred = DeferredVerdict(verdicts, row, caches[i].position)
        if verdicts.undecided[row]:
            by_drafts.setdefault(verdicts.undecided[row], []).append(i)
    for drafts, members in by_drafts.items():
        group = [caches[i] for i in members]
        group_rows = tuple(rows[i] for i in members)
        for slot, layer in enumerate(group[0].layers):
            if isinstance(layer, KVCache):
                continue
            for part in (0, 1):  # conv state, recurrent state
                _select_kept(group, group_rows, slot, part, drafts, verdicts)


def _select_kept(
    group: list[RequestCache],
    rows: tuple[int, ...],
    slot: int,
    part: int,
    drafts: int,
    verdicts: PendingVerdicts,
) -> None:
    """Layer `slot`'s state `part` of each cache of `group` (all with `drafts` undecided
    drafts) as the verdict leaves it: after the last step, or its snapshot at the kept length."""
    current = [c.layers[slot][part] for c in group]
    like = current[0].batch if isinstance(current[0], BatchRow) else current[0]
    shape = (1, *like.shape[1:])
    chosen = stack_rows(current, shape, like.dtype)
    confirmed = group[0].last_step_len - drafts
    for kept in range(drafts):
        snapshots = [c.snapshots[slot][confirmed + kept][part] for c in group]
        stacked = stack_rows(snapshots, shape, chosen.dtype)
        chosen = mx.where(verdicts.keeps(rows, kept, chosen.ndim), stacked, chosen)
    for cache, state in zip(group, batch_rows(chosen), strict=True):
        cache.layers[slot][part] = state


def make_layer_cache(is_linear: bool) -> LayerCache:
    return ArraysCache(size=2) if is_linear else SlabRowCache()


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
    # A verdict applied on the device, not yet read (`defer_verdicts`): until `resolve`,
    # `position` counts the positions its hole will give back.
    deferred: DeferredVerdict | None = None

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

    def drop_padding(self, pad: int) -> None:
        """Undo the `pad` positions that the last step ran after this request's own
        (`cluster.model.even_steps`): the attention caches trim them, and each GatedDeltaNet
        layer takes the state it recorded after the request's positions; the snapshots at and
        past them go (its own step records none there)."""
        own = self.last_step_len
        for index, cache in enumerate(self.layers):
            if isinstance(cache, KVCache):
                cache.trim(pad)
                continue
            snapshots = self.snapshots.get(index, {})
            if own not in snapshots:
                raise ValueError(f"no snapshot after position {own} of the step in layer {index}")
            cache[0], cache[1] = snapshots[own]
            kept = {keep: states for keep, states in snapshots.items() if keep < own}
            if kept:
                self.snapshots[index] = kept
            else:
                self.snapshots.pop(index, None)

    def resolve(self, drop: int) -> None:
        """The deferred verdict, read: it dropped `drop` positions. The step after it wrote its
        keys past the hole of the rejected drafts; they move down over it."""
        deferred, self.deferred = self.deferred, None
        if deferred is None or drop == 0:
            return
        start, end = deferred.hole_end - drop, deferred.hole_end
        length = self.position - end
        for cache in self.layers:
            if isinstance(cache, KVCache):
                # Copied first (`* 1`, exact): the source overlaps the destination.
                keys = cache.keys[..., end : end + length, :] * 1
                values = cache.values[..., end : end + length, :] * 1
                cache.write(start, keys, values)
                cache.offset -= drop
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
        self.deferred = None

    def record_snapshot(self, layer: int, keep: int, conv: RowState, state: RowState) -> None:
        self.snapshots.setdefault(layer, {})[keep] = (conv, state)

    def linear_state(self, layer: int) -> tuple[mx.array | None, mx.array | None]:
        """A GatedDeltaNet layer's (conv, recurrent) state as arrays of the request's own, a
        batch's row copied out: a slice would keep the whole batch's buffer alive for as long
        as the caller keeps it (a prefix snapshot: minutes)."""
        cache = self.layers[layer]
        return tuple(_detached(s) for s in (cache[0], cache[1]))

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
        """Every array the caches hold (to evaluate them together): for a batch's row, the
        batch's array."""
        out: list[mx.array] = []
        for cache in self.layers:
            if isinstance(cache, KVCache):
                if cache.keys is not None:
                    out += [cache.keys, cache.values]
            else:
                held = [a for a in cache.cache if a is not None]
                out += [a.batch if isinstance(a, BatchRow) else a for a in held]
        return out


@dataclass(frozen=True, slots=True)
class CacheMark:
    """A `RequestCache` at one moment (`RequestCache.mark`)."""

    position: int
    last_step_len: int
    snapshots: dict[int, dict[int, tuple[mx.array, mx.array]]]
    layers: tuple[LayerMark, ...]

    def trimmed(self, drop: int) -> CacheMark:
        """This mark of attention-only caches (the MTP head's) less its last `drop` positions."""
        if drop == 0:
            return self
        if not all(isinstance(held, int) for held in self.layers):
            raise ValueError("only attention caches can be trimmed")
        layers = tuple(held - drop for held in self.layers)
        last = max(self.last_step_len - drop, 0)
        return CacheMark(self.position - drop, last, {}, layers)
