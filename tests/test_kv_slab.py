"""A batch's attention over one key-value slab (`cluster.model.kv_slab`): the same outputs as
each request alone, the slab kept while the batch steps unchanged, and each request's row its
own to trim, write alone, or take out."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import CODE_PROMPTS

from cluster.model.cache import PendingVerdicts, RequestCache
from cluster.model.kv_slab import ALLOCATION_STEP, KVSlab, SlabRowCache, visible
from cluster.model.layers import Segment
from cluster.model.loading import load_shard

HEADS, DIM = 2, 4


def _step(seed: int, rows: int = 1, length: int = 1) -> mx.array:
    return mx.random.normal((rows, HEADS, length, DIM), key=mx.random.key(seed))


def _cache(positions: int, seed: int) -> SlabRowCache:
    cache = SlabRowCache()
    if positions:
        keys = _step(seed, length=positions)
        cache.update_and_fetch(keys, keys * 2)
    return cache


def _held(cache: SlabRowCache) -> mx.array:
    return cache.keys[..., : cache.offset, :]


def test_a_slab_holds_each_requests_keys_in_its_row_and_is_kept_while_they_step_together():
    caches = [_cache(3, 0), _cache(0, 1), _cache(7, 2)]
    before = [_held(c) if c.offset else None for c in caches]
    new = _step(9, rows=3)
    slab = KVSlab.of(caches, new, new * 2)
    assert slab.rows == 3 and slab.capacity == ALLOCATION_STEP
    assert all(c.slab is slab and c.row == i for i, c in enumerate(caches))
    for cache, held in zip(caches, before, strict=True):
        if held is None:  # nothing held yet: a row of zeros
            assert not cache.keys.any().item()
            continue
        assert mx.array_equal(_held(cache), held)
        assert mx.array_equal(cache.values[..., : cache.offset, :], held * 2)
    offsets = tuple(c.offset for c in caches)
    keys, values = slab.write(new, new * 2, offsets)
    assert keys.shape[2] == values.shape[2] == max(offsets) + 1
    for i, cache in enumerate(caches):
        cache.offset += 1
        assert mx.array_equal(_held(cache)[..., -1:, :], new[i : i + 1])
    assert KVSlab.of(caches, new, new) is slab  # the same requests in the same order
    reordered = KVSlab.of(caches[::-1], new, new)
    assert reordered is not slab and caches[0].row == 2
    assert mx.array_equal(_held(caches[0]), mx.concatenate([before[0], new[:1]], axis=2))


def test_rows_at_one_offset_take_one_slice_and_a_full_slab_grows_for_all_rows():
    caches = [_cache(ALLOCATION_STEP - 1, i) for i in range(2)]
    new = _step(5, rows=2, length=2)
    slab = KVSlab.of(caches, new, new)
    assert slab.capacity == 2 * ALLOCATION_STEP
    slab.write(new, new, (ALLOCATION_STEP - 1,) * 2)
    for i, cache in enumerate(caches):
        cache.offset += 2
        assert mx.array_equal(_held(cache)[..., -2:, :], new[i : i + 1])


def test_a_request_trims_writes_and_takes_out_its_own_row_alone():
    caches = [_cache(4, 0), _cache(6, 1)]
    new = _step(3, rows=2)
    slab = KVSlab.of(caches, new, new)
    other = _held(caches[1])
    caches[0].trim(2)  # a rejected draft: the offset alone
    alone = _step(4, length=2)
    keys, _ = caches[0].update_and_fetch(alone, alone)
    assert caches[0].slab is slab and keys.shape[2] == 4
    assert mx.array_equal(keys[..., 2:, :], alone) and mx.array_equal(_held(caches[1]), other)
    # No room left in the slab: the request takes its row out rather than grow the slab.
    caches[0].offset = ALLOCATION_STEP - 1
    held = _held(caches[0])
    keys, _ = caches[0].update_and_fetch(alone, alone)
    assert caches[0].slab is None and slab.capacity == ALLOCATION_STEP
    assert mx.array_equal(keys[..., : ALLOCATION_STEP - 1, :], held)
    assert mx.array_equal(keys[..., -2:, :], alone) and mx.array_equal(_held(caches[1]), other)
    assert caches[1].nbytes == slab.nbytes // 2
    caches[1].keys, caches[1].values = other, other  # a snapshot restored: its own arrays
    assert caches[1].slab is None and caches[1].keys is other


def test_each_row_sees_its_own_positions_and_not_the_hole_of_its_rejected_drafts():
    mask = visible((1, 3), 2)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, False, False, False], [True] * 3 + [False] * 2]
    assert mask[1, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    # Row 0 held 3 positions, of which its verdict drops the last 2; row 1 drops nothing.
    verdicts = PendingVerdicts([mx.array(0, mx.uint32), mx.array(1, mx.uint32)], [2, 1])
    held = verdicts.visible((0, 1), (3, 3), (3, 3), 1)
    assert held[0, 0].tolist() == [[True, False, False, True]]
    assert held[1, 0].tolist() == [[True] * 4]


@pytest.fixture(scope="module", params=["bundled", "moe"])
def shard_and_prompts(request, model_dir, tokenizer, tmp_path_factory):
    """The bundled model and code prompts, or the MoE fixture and token lists."""
    if request.param == "bundled":
        return load_shard(model_dir), [tokenizer.encode(p) for p in CODE_PROMPTS[:3]]
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("moe") / "moe", moe=True)
    return load_shard(path), [[5, 17, 300, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13]]


def _forward(shard, caches, steps):
    """One step of `steps` [(tokens, confirmed)] through `caches`, packed into one call."""
    segments = []
    for cache, (tokens, confirmed) in zip(caches, steps, strict=True):
        cache.begin_step(0, len(tokens))
        segments.append(Segment(cache, len(tokens), confirmed))
    tokens = mx.array([t for tokens, _ in steps for t in tokens])[None]
    out = shard(shard.embed(tokens), segments)
    mx.eval(out, [c.arrays() for c in caches])
    return out


@pytest.mark.skipif(
    mx.cuda.is_available(), reason="MLX CUDA rounds batched rows otherwise (test_decode_fast_path)"
)
def test_a_batch_step_computes_what_each_request_alone_does(shard_and_prompts) -> None:
    shard, prompts = shard_and_prompts
    batch = [RequestCache.for_layers(shard.linear_flags) for _ in prompts]
    alone = [RequestCache.for_layers(shard.linear_flags) for _ in prompts]
    for caches in (batch, alone):
        for cache, prompt in zip(caches, prompts, strict=True):
            _forward(shard, [cache], [(prompt, len(prompt))])
    attention = shard.linear_flags.index(False)
    # Plain steps, steps with a draft, a rejected draft rolled back in one request only.
    # The first batch step attends request by request; from the second, over one slab.
    for step, (steps, rollback) in enumerate(
        [
            ([((5,), 1), ((6,), 1), ((7,), 1)], None),
            ([((8,), 1), ((9,), 1), ((10,), 1)], None),
            ([((8, 9), 1), ((10, 11), 1), ((12, 13), 1)], 1),
            ([((14,), 1), ((15,), 1), ((16,), 1)], None),
        ]
    ):
        together = _forward(shard, batch, steps)
        one_by_one = mx.concatenate(
            [_forward(shard, [c], [s]) for c, s in zip(alone, steps, strict=True)], axis=1
        )
        assert mx.array_equal(together, one_by_one)
        slabs = {c.layers[attention].slab for c in batch}
        assert slabs == {None} if step == 0 else len(slabs) == 1 and None not in slabs
        if rollback:
            batch[rollback].rollback(1)
            alone[rollback].rollback(1)
    for b, a in zip(batch, alone, strict=True):
        assert b.position == a.position
        for mine, theirs in zip(b.layers, a.layers, strict=True):
            if isinstance(mine, SlabRowCache):
                assert mx.array_equal(_held(mine), _held(theirs))
