"""A request's GatedDeltaNet state kept as its row of a batch step's arrays (`BatchRow`), the
stacking of those rows for the next batch step (`stack_rows`), and a verdict taken on the
device before it is read (`defer_verdicts`, `RequestCache.resolve`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cluster.model.cache import (
    BatchRow,
    PendingVerdicts,
    RequestCache,
    batch_rows,
    defer_verdicts,
    own,
    stack_rows,
)

SHAPE = (1, 3, 4)


def _batch(seed: int, size: int = 3) -> mx.array:
    return mx.random.normal((size, *SHAPE[1:]), key=mx.random.key(seed))


def test_a_batch_that_steps_again_unchanged_takes_its_array_as_it_is() -> None:
    batch = _batch(0)
    assert stack_rows(batch_rows(batch), SHAPE, mx.float32) is batch


def test_rows_of_several_batches_are_merged_row_by_row() -> None:
    """After a rejected draft some requests hold a snapshot's row, the others the step's."""
    final, snap_1, snap_2 = _batch(0), _batch(1), _batch(2)
    rows = [BatchRow(snap_1, 0), BatchRow(final, 1), BatchRow(snap_2, 2)]
    expected = mx.concatenate([snap_1[0:1], final[1:2], snap_2[2:3]])
    assert mx.array_equal(stack_rows(rows, SHAPE, mx.float32), expected)


def test_rows_out_of_place_or_mixed_with_arrays_are_gathered() -> None:
    batch, alone, pair = _batch(0), _batch(5, size=1), _batch(6, size=2)
    cases = [
        # a batch's rows in another order
        ([BatchRow(batch, i) for i in (2, 0, 1)], [batch[2:3], batch[:1], batch[1:2]]),
        # a batch's row beside a request's own state and a first step's
        ([BatchRow(batch, 0), alone, None], [batch[:1], alone, mx.zeros(SHAPE)]),
        # rows of batches of another size
        ([BatchRow(pair, 0), BatchRow(batch, 1)], [pair[:1], batch[1:2]]),
    ]
    for rows, parts in cases:
        assert mx.array_equal(stack_rows(rows, SHAPE, mx.float32), mx.concatenate(parts))


def test_one_request_gets_its_own_state_or_zeros() -> None:
    batch = _batch(0)
    assert mx.array_equal(stack_rows([BatchRow(batch, 1)], SHAPE, mx.float32), batch[1:2])
    zeros = stack_rows([None], SHAPE, mx.bfloat16)
    assert zeros.shape == SHAPE and zeros.dtype == mx.bfloat16 and not zeros.any().item()


def test_a_cache_counts_and_hands_out_only_its_row() -> None:
    batch = _batch(0)
    cache = RequestCache.for_layers([True, False])
    cache.layers[0][0], cache.layers[0][1] = BatchRow(batch, 1), BatchRow(batch, 2)
    assert cache.nbytes == 2 * batch.nbytes // 3
    conv, state = cache.linear_state(0)
    assert mx.array_equal(conv, batch[1:2]) and mx.array_equal(state, batch[2:3])
    held = cache.arrays()  # to evaluate: the batch's array, whose row is the request's
    assert len(held) == 2 and all(a is batch for a in held)
    assert mx.array_equal(own(cache.layers[0][0]), batch[1:2])


def test_a_row_handed_out_does_not_keep_its_batch() -> None:
    """A prefix snapshot keeps `linear_state` for minutes: a slice would pin all the rows."""
    batch = mx.random.normal((8, 256, 1024))  # 1 MiB a row
    mx.eval(batch)
    cache = RequestCache.for_layers([True])
    cache.layers[0][0], cache.layers[0][1] = BatchRow(batch, 3), None
    conv, state = cache.linear_state(0)
    mx.eval(conv)
    expected = mx.array(np.array(batch[3:4]))
    del batch, cache
    mx.clear_cache()
    before = mx.get_active_memory()
    assert state is None and mx.array_equal(conv, expected)
    del conv, expected
    freed = before - mx.get_active_memory()
    assert 2 << 20 <= freed < 3 << 20  # the row and its copy, not the batch's 8 rows


# ---- a verdict taken on the device (`defer_verdicts`), then read (`resolve`) ----

HEADS, DIM = 2, 4


def _stepped(seed: int, held: int) -> RequestCache:
    """A cache of one GatedDeltaNet layer and one attention layer after a step [y, d] at
    positions held-2, held-1 (a snapshot after y kept), before the verdict on d is read."""
    key = mx.random.key(seed)
    cache = RequestCache.for_layers([True, False])
    gdn, attention = cache.layers
    gdn[0], gdn[1] = _batch(seed, size=1), _batch(seed + 100, size=1)  # after [y, d]
    cache.record_snapshot(0, 1, _batch(seed + 200, size=1), _batch(seed + 300, size=1))
    keys = mx.random.normal((1, HEADS, held, DIM), key=key)
    attention.update_and_fetch(keys, keys * 2)
    cache.last_step_len, cache.position = 2, held
    return cache


def test_a_deferred_verdict_selects_the_states_and_masks_the_rejected_draft() -> None:
    """Request 0 rejected its draft, request 1 accepted it: each GatedDeltaNet state is the
    snapshot or the step's; the next step's positions move back by the drop, and request 0's
    mask hides the rejected draft's key."""
    held = 6
    caches = [_stepped(0, held), _stepped(1, held)]
    expected = [caches[0].snapshots[0][1], (caches[1].layers[0][0], caches[1].layers[0][1])]
    verdicts = PendingVerdicts([mx.array(0, mx.uint32), mx.array(1, mx.uint32)], [1, 1])
    defer_verdicts(caches, verdicts, [0, 1])
    for cache, (conv, state) in zip(caches, expected, strict=True):
        assert mx.array_equal(own(cache.layers[0][0]), own(conv))
        assert mx.array_equal(own(cache.layers[0][1]), own(state))
        assert cache.deferred is not None and cache.deferred.hole_end == held
    assert verdicts.offsets((0, 1), (held, held)).tolist() == [held - 1, held]
    # The next step's 2 positions go to slots 6 and 7; request 0's slot 5 is the hole.
    rejected, accepted = verdicts.mask(0, held, 2).tolist(), verdicts.mask(1, held, 2).tolist()
    assert rejected == [[1, 1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0, 1, 1]]
    assert accepted == [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]]


def test_resolve_moves_the_next_steps_keys_over_the_hole() -> None:
    held = 6
    cache = _stepped(2, held)
    before = cache.layers[1].keys[..., :held, :]
    defer_verdicts([cache], PendingVerdicts([mx.array(0, mx.uint32)], [1]), [0])
    cache.begin_step(0, 2)  # the step built ahead writes its keys at slots 6, 7
    new = mx.random.normal((1, HEADS, 2, DIM), key=mx.random.key(9))
    cache.layers[1].update_and_fetch(new, new * 2)
    cache.resolve(1)
    attention = cache.layers[1]
    assert cache.deferred is None and cache.position == attention.offset == held + 1
    assert mx.array_equal(attention.keys[..., : held - 1, :], before[..., : held - 1, :])
    assert mx.array_equal(attention.keys[..., held - 1 : held + 1, :], new)
    assert mx.array_equal(attention.values[..., held - 1 : held + 1, :], new * 2)


def test_an_undone_deferral_restores_every_state() -> None:
    held = 6
    cache = _stepped(3, held)
    mark = cache.mark()
    gdn = (cache.layers[0][0], cache.layers[0][1])
    defer_verdicts([cache], PendingVerdicts([mx.array(0, mx.uint32)], [1]), [0])
    cache.begin_step(0, 2)
    cache.restore(mark)
    assert cache.deferred is None and cache.position == held and cache.last_step_len == 2
    assert cache.layers[0][0] is gdn[0] and cache.layers[0][1] is gdn[1]
    assert cache.layers[1].offset == held and 1 in cache.snapshots[0]
