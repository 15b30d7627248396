"""Shards run one after another give the whole model's logits (and mlx-lm's)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import CODE_PROMPTS
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load

from cluster.model.cache import RequestCache
from cluster.model.layers import Segment
from cluster.model.loading import load_shard
from cluster.model.shard import ModelShard, ShardSpec, async_eval_slots


def _logits(shards: list[ModelShard], tokens: list[int]) -> np.ndarray:
    x = shards[0].embed(mx.array(tokens)[None])
    for shard in shards:
        cache = RequestCache.for_layers(shard.linear_flags)
        x = shard(x, [Segment(cache, len(tokens), len(tokens))])
    tail = shards[-1]
    return np.array(tail.logits(tail.norm(x)).astype(mx.float32))


@pytest.mark.parametrize("split", [[(0, 3), (3, 8)], [(0, 1), (1, 4), (4, 8)]])
def test_split_shards_give_the_whole_models_logits(model_dir, tokenizer, split) -> None:
    tokens = tokenizer.encode(CODE_PROMPTS[2])
    whole = _logits([load_shard(model_dir)], tokens)
    last = len(split) - 1
    shards = [
        load_shard(model_dir, ShardSpec(s, e, i == 0, i == last)) for i, (s, e) in enumerate(split)
    ]
    np.testing.assert_array_equal(_logits(shards, tokens), whole)

    model, _ = mlx_lm_load(str(model_dir))
    theirs = np.array(model(mx.array(tokens)[None]).astype(mx.float32))
    np.testing.assert_allclose(whole, theirs, atol=1e-2, rtol=1e-2)
    assert (whole.argmax(-1) == theirs.argmax(-1)).all()


def test_middle_shard_holds_only_its_layers(model_dir) -> None:
    middle = load_shard(model_dir, ShardSpec(3, 5, False, False))
    names = set(dict(tree_flatten(middle.parameters())))
    assert all(n.startswith(("layers.0.", "layers.1.")) for n in names)
    assert not hasattr(middle, "embed_tokens") and not hasattr(middle, "mtp")


def test_layer_range_beyond_the_model_is_refused(model_dir) -> None:
    with pytest.raises(ValueError, match="exceeds the model's 8 layers"):
        load_shard(model_dir, ShardSpec(6, 9, False, True))
    with pytest.raises(ValueError, match="invalid layer range"):
        ShardSpec(3, 3, True, False)


@pytest.mark.parametrize(
    ("layers", "slots"),
    [
        # after 1, 2 and 4 layers, every 8, the last chunk in halves to one layer
        (32, [0, 1, 3, 7, 15, 23, 27, 29, 30, 31]),
        (64, [0, 1, 3, 7, 15, 23, 31, 39, 47, 55, 59, 61, 62, 63]),
        (33, [0, 1, 3, 7, 15, 23, 28, 30, 31]),  # the last layer starts with the caller's eval
        (3, []),  # fewer layers than a chunk: the caller's eval alone
    ],
)
def test_the_device_is_started_every_8_layers_and_tapered_at_both_ends(layers, slots) -> None:
    assert sorted(async_eval_slots(layers, 8, True, True)) == slots
    every = [s for s in range(layers) if s % 8 == 7]
    assert sorted(async_eval_slots(layers, 8, False, False)) == every
    assert sorted(async_eval_slots(layers, 8, True, False)) == sorted(
        set(every) | ({0, 1, 3} if every else set())
    )
