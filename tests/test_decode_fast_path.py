"""The decoding fast path computes exactly what the plain path does.

Fused projections (`cluster.model.fused`), compiled GatedDeltaNet steps
(`cluster.model.compiled_steps`: the recurrence alone, or whole layers) and steps padded to 8
rows (`cluster.model.row_padding`) are asked for here by each shard's `DecodeFastPath` (by
default they are on for CUDA only): logits, greedy tokens and the caches after a rejected draft
must equal those of shards built with `DecodeFastPath.plain()`, on the bundled model and a MoE
fixture.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import CODE_PROMPTS, run
from test_engine import _generate_all
from test_rollback import _assert_same_caches, _prefill

from cluster.decode.engine import GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.decode.runner import ShardRunner
from cluster.messages import RequestOptions, StepRequest
from cluster.model import fused, row_padding
from cluster.model.cache import RequestCache
from cluster.model.fast_path import DecodeFastPath
from cluster.model.layers import Segment
from cluster.model.loading import load_shard

# Bitwise identity with the plain ops is the CPU backend's: MLX CUDA picks its matmul kernels
# by row count, so padded or batched rows round differently there. On CUDA,
# tests/test_few_row_matmul.py checks the greedy text up to ties instead.
pytestmark = pytest.mark.skipif(
    mx.cuda.is_available(), reason="bitwise identity across row counts holds on the CPU only"
)

PLAIN = DecodeFastPath.plain()
# Everything on, steps of 2 rows and more padded (the kernels run on CUDA only).
FAST = DecodeFastPath.everything(pad_rows_from=2)


def test_the_default_here_is_the_plain_path() -> None:
    """On the CPU the device's default asks for none of it (on CUDA, all of it)."""
    assert DecodeFastPath.for_device() == PLAIN
    assert FAST.compiled_steps and FAST.compiled_layers and FAST.compiled_batches
    with pytest.raises(dataclasses.FrozenInstanceError):
        FAST.compiled_steps = False  # type: ignore[misc]


def _logits(shard, prompt: list[int], steps: list[tuple[int, ...]]) -> list[mx.array]:
    """Prefill, then steps whose first position is confirmed and the rest drafts."""
    cache = RequestCache.for_layers(shard.linear_flags)
    cache.begin_step(0, len(prompt))
    hidden = shard(shard.embed(mx.array(prompt)[None]), [Segment(cache, len(prompt), len(prompt))])
    out = [shard.logits(shard.norm(hidden[:, -1]))]
    for tokens in steps:
        cache.begin_step(0, len(tokens))
        hidden = shard(shard.embed(mx.array(tokens)[None]), [Segment(cache, len(tokens), 1)])
        out.append(shard.logits(shard.norm(hidden)))
    mx.eval(out, cache.arrays())
    return out


@pytest.mark.parametrize(
    ("bits", "whole_layers", "pad_from"),
    [(None, True, 2), (None, False, 1), (4, True, 1), (4, False, row_padding.PAD_FROM)],
)
def test_fused_compiled_padded_logits_equal_plain(
    model_dir, tokenizer, bits, whole_layers, pad_from
) -> None:
    # whole_layers False: only the recurrence is compiled
    chosen = DecodeFastPath.everything(pad_rows_from=pad_from)
    chosen = dataclasses.replace(chosen, compiled_layers=whole_layers)
    plain = load_shard(model_dir, fast_path=PLAIN)
    fast = load_shard(model_dir, for_decoding=bits is None, fast_path=chosen)
    if bits is not None:  # the bundled model is bf16: quantize both alike, then fuse one
        for shard in (plain, fast):
            nn.quantize(shard, group_size=64, bits=bits)
        assert fused.fuse_projections(fast) == 2 * (
            len(fast.layers) + 1
        )  # mixer + MLP, MTP layer too
    assert "in_proj" in fast.layers[0].linear_attn and "qkv_proj" in fast.layers[3].self_attn
    assert fast.pads_rows and not plain.pads_rows
    assert fast.fast_path is chosen and plain.fast_path is PLAIN
    prompt = tokenizer.encode(CODE_PROMPTS[0])
    # 1 to 5 positions: padded rows from `pad_from` on, snapshots after the first
    steps = [(5,), (7, 9), (11,), (3, 4, 8), (12,), (1, 2, 6, 10, 13)]
    reference = _logits(plain, prompt, steps)
    for a, b in zip(reference, _logits(fast, prompt, steps), strict=True):
        assert mx.array_equal(a, b)
    # The whole layers ran compiled, or none did; the plain shard compiled nothing.
    assert bool(fast.layers[0]._traces.steps) == whole_layers
    assert not plain.layers[0]._traces.steps


def test_layers_quantized_apart_are_not_computed_with_each_others_settings(
    model_dir, tokenizer
) -> None:
    """A mixed-precision checkpoint: one GatedDeltaNet layer at 8 bits, the rest at 4. The
    compiled layer step's trace takes a layer's weights as inputs; only layers of one structure
    share it, so the 8-bit layer is not dequantized with 4-bit settings, nor the others."""

    def eight_bits_in_layer_1(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % 64:
            return False
        return {"group_size": 64, "bits": 8} if path.startswith("layers.1.") else True

    plain, fast = load_shard(model_dir, fast_path=PLAIN), load_shard(model_dir, fast_path=FAST)
    for shard in (plain, fast):
        nn.quantize(shard, group_size=64, bits=4, class_predicate=eight_bits_in_layer_1)
    assert fast.layers[1].mlp.down_proj.bits == 8 and fast.layers[0].mlp.down_proj.bits == 4
    fused.fuse_projections(fast)
    prompt = tokenizer.encode(CODE_PROMPTS[0])
    steps = [(5,), (7, 9), (11,)]
    reference = _logits(plain, prompt, steps)
    for a, b in zip(reference, _logits(fast, prompt, steps), strict=True):
        assert mx.array_equal(a, b)
    # The 8-bit layer got a trace of its own.
    structures = {key[0] for key in fast.layers[0]._traces.steps}
    assert len(structures) == 2


def test_padding_is_for_short_dense_steps() -> None:
    padded_rows = row_padding.padded_rows
    assert [padded_rows(n, 2) for n in (1, 2, 7, 8, 30)] == [1, 8, 8, 8, 30]
    assert row_padding.PAD_FROM == 4  # the default threshold
    assert [padded_rows(n, row_padding.PAD_FROM) for n in (2, 3, 4, 7)] == [2, 3, 8, 8]
    assert padded_rows(1, 1) == 8
    assert [padded_rows(n, None) for n in (1, 5, 30)] == [1, 5, 30]
    for bad in (0, row_padding.PAD_TO + 1):
        with pytest.raises(ValueError, match="pad_rows_from"):
            DecodeFastPath(pad_rows_from=bad)
    x = mx.ones((1, 3, 4))
    padded = row_padding.pad_rows(x, 8)
    assert padded.shape == (1, 8, 4) and mx.array_equal(padded[:, :3], x)
    assert not padded[:, 3:].any().item()


def test_fast_path_greedy_identity_and_exact_rollback(model_dir, tokenizer) -> None:
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS[:2]]
    fast = {
        mtp: run(_generate_all(model_dir, prompts, mtp=mtp, fast_path=FAST))
        for mtp in (False, True)
    }
    # Batched: whole compiled layers (one trace for every layer), then the plain ops for the
    # batch, then the recurrence alone compiled per batch shape.
    batched = {
        "batched": FAST,
        "batched, plain": dataclasses.replace(FAST, compiled_layers=False, compiled_batches=False),
        "batched, compiled recurrence": dataclasses.replace(FAST, compiled_layers=False),
    }
    for kind, chosen in batched.items():
        fast[kind] = run(
            _generate_all(model_dir, prompts, mtp=True, concurrent=True, fast_path=chosen)
        )
    reference = run(_generate_all(model_dir, prompts, mtp=False, fast_path=PLAIN))
    for outs in fast.values():
        assert [o.tokens for o in outs] == [o.tokens for o in reference]
    assert 0 < sum(o.accepted for o in fast[True]) < sum(o.drafted for o in fast[True])
    for kind in ("batched", "batched, plain", "batched, compiled recurrence"):
        assert sum(o.drafted for o in fast[kind]) > 0

    # A rejected draft on the compiled path leaves the caches as if never seen.
    shard = load_shard(model_dir, for_decoding=True, fast_path=FAST)
    prompt = tuple(prompts[0])
    drafted, clean = ShardRunner(shard), ShardRunner(shard)
    first = _prefill(drafted, "r", prompt)
    assert _prefill(clean, "r", prompt) == first
    (y,), n = first.tokens, len(prompt)
    wrong = (first.drafts[0] + 1) % 8192
    (rejected,) = drafted.run([StepRequest("r", (y, wrong), n, draft_len=1)]).results
    assert rejected.keep == 1 and rejected.accepted == 0
    (alone,) = clean.run([StepRequest("r", (y,), n)]).results
    assert rejected.tokens == alone.tokens and rejected.drafts == alone.drafts
    nxt = StepRequest("r", alone.tokens, n + 1)
    carried = StepRequest("r", nxt.tokens, nxt.position, rollback=1)
    assert drafted.run([carried]).results == clean.run([nxt]).results
    _assert_same_caches(drafted.requests["r"].cache, clean.requests["r"].cache)


async def _generate_at_depth(
    model_dir, prompts: list[list[int]], depth: int, fast_path: DecodeFastPath
) -> list:
    local = await open_local_engine(model_dir, fast_path=fast_path)
    try:
        options = RequestOptions(mtp=depth > 0, mtp_depth=depth)
        return [
            await local.engine.generate(GenerationRequest(tuple(p), 24, options)) for p in prompts
        ]
    finally:
        local.close()


def test_deep_drafts_padded_greedy_identity(model_dir, tokenizer) -> None:
    """Depth 3 and 4: steps of 4 and 5 rows, padded from the default threshold on."""
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS[:2]]
    reference = run(_generate_at_depth(model_dir, prompts, 0, PLAIN))
    padded = DecodeFastPath.everything(pad_rows_from=row_padding.PAD_FROM)
    for depth in (3, 4):
        outs = run(_generate_at_depth(model_dir, prompts, depth, padded))
        assert [o.tokens for o in outs] == [o.tokens for o in reference]
        assert 0 < sum(o.accepted for o in outs) < sum(o.drafted for o in outs)


def test_moe_fast_path_greedy_identity(tmp_path) -> None:
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "moe", moe=True, mtp_experts="fused")
    # Zero rows would be routed to experts: asked for, padding is left out.
    assert not load_shard(path, fast_path=FAST).pads_rows
    prompts = [[5, 17, 300, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    fast = run(_generate_all(path, prompts, mtp=True, fast_path=FAST))
    # The two requests batched, their recurrence compiled per batch shape.
    batch_recurrence = dataclasses.replace(FAST, compiled_layers=False)
    batched = run(
        _generate_all(path, prompts, mtp=True, concurrent=True, fast_path=batch_recurrence)
    )
    reference = run(_generate_all(path, prompts, mtp=False, fast_path=PLAIN))
    assert [o.tokens for o in fast] == [o.tokens for o in reference]
    assert [o.tokens for o in batched] == [o.tokens for o in reference]
    assert sum(o.drafted for o in fast) > 0 and sum(o.drafted for o in batched) > 0


@pytest.mark.parametrize("whole_layers", [False, True])
def test_compiled_batch_rejected_drafts_are_undone_exactly(
    model_dir, tokenizer, whole_layers
) -> None:
    """Two requests in one step of the same shape run the batch's compiled recurrence (or, with
    `whole_layers`, the batch's compiled layers); both drafts rejected, every cache equals a
    run that never saw them."""
    chosen = dataclasses.replace(FAST, compiled_layers=whole_layers)
    shard = load_shard(model_dir, for_decoding=True, fast_path=chosen)
    prompts = [tuple(tokenizer.encode(p)) for p in CODE_PROMPTS[:2]]
    drafted, clean = ShardRunner(shard), ShardRunner(shard)
    firsts = [_prefill(drafted, f"r{i}", p) for i, p in enumerate(prompts)]
    assert [_prefill(clean, f"r{i}", p) for i, p in enumerate(prompts)] == firsts
    wrong = [
        StepRequest(f"r{i}", (f.tokens[0], (f.drafts[0] + 1) % 8192), len(p), draft_len=1)
        for i, (f, p) in enumerate(zip(firsts, prompts, strict=True))
    ]
    rejected = drafted.run(wrong).results
    assert [(r.keep, r.accepted) for r in rejected] == [(1, 0), (1, 0)]
    alone = clean.run([StepRequest(s.request_id, s.tokens[:1], s.position) for s in wrong]).results
    assert [(r.tokens, r.drafts) for r in rejected] == [(r.tokens, r.drafts) for r in alone]
    following = [
        StepRequest(s.request_id, r.tokens, s.position + 1)
        for s, r in zip(wrong, alone, strict=True)
    ]
    carried = [StepRequest(s.request_id, s.tokens, s.position, rollback=1) for s in following]
    assert drafted.run(carried).results == clean.run(following).results
    for i in range(2):
        _assert_same_caches(drafted.requests[f"r{i}"].cache, clean.requests[f"r{i}"].cache)
    assert bool(shard.layers[0]._traces.steps) == whole_layers
