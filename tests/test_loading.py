"""cluster.model.loading: whole models and shards, both layouts, a shard's tensors, bad inputs."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import mlx.core as mx
import pytest
from checkpoints import EXPERT_INTERMEDIATE, EXPERTS, HIDDEN, make_checkpoint
from mlx.utils import tree_flatten

from cluster.config import ModelDirError
from cluster.model.cache import RequestCache
from cluster.model.layers import Segment
from cluster.model.loading import load_shard, shard_tensor_names
from cluster.model.shard import ModelShard, ShardSpec

TOKENS = [607, 547, 201, 607, 649, 581, 537, 2251, 10, 1662]


def spec(start: int, end: int, num_layers: int) -> ShardSpec:
    return ShardSpec(start, end, is_head=start == 0, is_tail=end == num_layers)


def forward(shards: list[ModelShard], tokens: list[int] = TOKENS) -> mx.array:
    """Logits of a prompt run through the shards one after the other."""
    n = len(tokens)
    x = shards[0].embed(mx.array(tokens)[None])
    for shard in shards:
        cache = RequestCache.for_layers(shard.linear_flags)
        cache.begin_step(0, n)
        x = shard(x, [Segment(cache, n, n)])
    return shards[-1].logits(shards[-1].norm(x)).astype(mx.float32)


def params(shard: ModelShard) -> dict[str, mx.array]:
    return dict(tree_flatten(shard.parameters()))


def raw_tensors(model_dir: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


def rewrite(model_dir: Path, key: str, value: mx.array | None) -> None:
    """Replace (or with None, remove) one tensor of a checkpoint, index included."""
    index_file = model_dir / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    file = model_dir / index["weight_map"][key]
    tensors = dict(mx.load(str(file)))
    if value is None:
        del tensors[key], index["weight_map"][key]
    else:
        tensors[key] = value
    mx.save_safetensors(str(file), tensors, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))


def edit_config(model_dir: Path, **changes: object) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


# -- the bundled model ---------------------------------------------------------------------


def test_bundled_model_loads_whole_and_as_shards(model_dir: Path) -> None:
    whole = load_shard(model_dir)
    head, tail = load_shard(model_dir, spec(0, 3, 8)), load_shard(model_dir, spec(3, 8, 8))
    assert whole.has_mtp and tail.has_mtp and not head.has_mtp
    assert (len(head.layers), len(tail.layers)) == (3, 5)
    assert not hasattr(head, "lm_head") and not hasattr(head, "norm")
    assert hasattr(tail, "embed_tokens")  # the MTP head needs it on the tail
    whole_params = params(whole)
    for shard, offset in ((head, 0), (tail, 3)):
        for name, value in params(shard).items():
            parts = name.split(".")
            if parts[0] == "layers":
                parts[1] = str(int(parts[1]) + offset)
            assert mx.array_equal(value, whole_params[".".join(parts)]), name
    assert mx.array_equal(forward([head, tail]), forward([whole]))


def test_norms_are_shifted_once_and_conv_transposed(model_dir: Path) -> None:
    raw = raw_tensors(model_dir)
    for shard, layer in ((load_shard(model_dir), 5), (load_shard(model_dir, spec(4, 8, 8)), 1)):
        got = shard.layers[layer]
        source = "model.language_model.layers.5"
        assert mx.array_equal(
            got.input_layernorm.weight, raw[f"{source}.input_layernorm.weight"] + 1
        )
        assert mx.array_equal(got.linear_attn.norm.weight, raw[f"{source}.linear_attn.norm.weight"])
        conv = raw[f"{source}.linear_attn.conv1d.weight"]
        assert mx.array_equal(got.linear_attn.conv1d.weight, conv.moveaxis(2, 1))
        assert mx.array_equal(shard.mtp.norm.weight, raw["mtp.norm.weight"] + 1)


def test_shard_reads_only_its_tensors(model_dir: Path) -> None:
    head = set(shard_tensor_names(model_dir, spec(0, 2, 8)))
    assert head == {"model.language_model.embed_tokens.weight"} | {
        k for k in raw_tensors(model_dir) if k.startswith(("model.language_model.layers.0.",
                                                         "model.language_model.layers.1."))
    }  # fmt: skip
    middle = set(shard_tensor_names(model_dir, ShardSpec(2, 4, is_head=False, is_tail=False)))
    assert all(k.startswith(("model.language_model.layers.2.", "model.language_model.layers.3."))
               for k in middle)  # fmt: skip
    tail = set(shard_tensor_names(model_dir, spec(4, 8, 8)))
    assert {"lm_head.weight", "model.language_model.norm.weight", "mtp.fc.weight"} <= tail
    assert not any(".layers.3." in k for k in tail)

    def loaded_bytes(shard_spec: ShardSpec | None) -> tuple[int, int]:
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        shard = load_shard(model_dir, shard_spec)
        used, peak = mx.get_active_memory() - base, mx.get_peak_memory() - base
        del shard
        return used, peak

    whole_used, _ = loaded_bytes(None)
    head_used, head_peak = loaded_bytes(spec(0, 2, 8))
    assert whole_used >= 20e6  # the bundled model: 24 MB of bf16
    assert head_used < 0.4 * whole_used and head_peak < 0.4 * whole_used


@pytest.mark.parametrize(
    ("model", "for_decoding"), [("bundled", False), ("bundled", True), ("moe", True)]
)
def test_loading_holds_no_tensor_twice(
    model_dir: Path, tmp_path: Path, model: str, for_decoding: bool
) -> None:
    """A shard's load peaks at its own bytes, with projections fused too: their parts are
    read into the fused arrays a layer at a time and freed (the peak was 1.44x, and a 27B
    bf16 shard overran an 80 GB GPU). The MoE fixture's experts come fused in its raw layout
    and are split at load."""
    path = model_dir if model == "bundled" else make_checkpoint(tmp_path, moe=True)
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    shard = load_shard(path, for_decoding=for_decoding)
    params = sum(v.nbytes for _, v in tree_flatten(shard.parameters()))
    assert mx.get_peak_memory() - base <= 1.02 * params


# -- the random fixtures ---------------------------------------------------------------------


@pytest.mark.parametrize("mtp_experts", ["per_expert", "fused"])
def test_moe_fixture_loads_in_both_mtp_layouts(tmp_path: Path, mtp_experts: str) -> None:
    ckpt = make_checkpoint(tmp_path, moe=True, mtp_experts=mtp_experts)
    shard = load_shard(ckpt)
    assert shard.has_mtp and shard.layers[0].mlp.switch_mlp.gate_proj.weight.shape == (
        EXPERTS,
        EXPERT_INTERMEDIATE,
        HIDDEN,
    )
    raw = raw_tensors(ckpt)
    mlp = shard.mtp.layers[0].mlp.switch_mlp
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if mtp_experts == "per_expert":
            keys = [f"mtp.layers.0.mlp.experts.{e}.{proj}.weight" for e in range(EXPERTS)]
            expected = mx.stack([raw[k] for k in keys])
        elif proj == "down_proj":
            expected = raw["mtp.layers.0.mlp.experts.down_proj"]
        else:
            gate_up = raw["mtp.layers.0.mlp.experts.gate_up_proj"]
            mid = EXPERT_INTERMEDIATE
            expected = gate_up[:, :mid] if proj == "gate_proj" else gate_up[:, mid:]
        got = getattr(mlp, proj).weight
        assert mx.array_equal(got, expected.astype(got.dtype)), proj
    assert mx.all(mx.isfinite(forward([shard]))).item()


def test_moe_layouts_of_one_seed_hold_the_same_model(tmp_path: Path) -> None:
    a = load_shard(make_checkpoint(tmp_path / "a", moe=True, mtp_experts="per_expert"))
    b = load_shard(make_checkpoint(tmp_path / "b", moe=True, mtp_experts="fused"))
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    assert all(mx.array_equal(pa[k], pb[k]) for k in pa)


def test_moe_fixture_shards_compose_to_the_whole(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=True)
    shards = [load_shard(ckpt, spec(0, 1, 4)), load_shard(ckpt, spec(1, 4, 4))]
    assert mx.array_equal(forward(shards), forward([load_shard(ckpt)]))


def test_tied_fixture_loads(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=False, tie_word_embeddings=True)
    assert "lm_head.weight" not in raw_tensors(ckpt)
    shard = load_shard(ckpt)
    assert shard.tied and not hasattr(shard, "lm_head") and shard.has_mtp
    assert "lm_head.weight" not in set(shard_tensor_names(ckpt, spec(0, 4, 4)))
    tail = load_shard(ckpt, spec(2, 4, 4))
    assert mx.array_equal(tail.embed_tokens.weight, shard.embed_tokens.weight)
    logits = forward([shard])
    assert logits.shape == (1, len(TOKENS), 8192) and mx.all(mx.isfinite(logits)).item()


def test_fixture_is_deterministic(tmp_path: Path) -> None:
    a = raw_tensors(make_checkpoint(tmp_path / "a", moe=True, seed=3))
    b = raw_tensors(make_checkpoint(tmp_path / "b", moe=True, seed=3))
    c = raw_tensors(make_checkpoint(tmp_path / "c", moe=True, seed=4))
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    assert not mx.array_equal(a["mtp.fc.weight"], c["mtp.fc.weight"])


# -- bad inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.layers.0.self_attn.k_proj.weight",
        "mtp.layers.0.mlp.experts.1.up_proj.weight",
    ],
)
def test_missing_mtp_tensor_is_named(tmp_path: Path, key: str) -> None:
    ckpt = make_checkpoint(tmp_path, moe=True)
    rewrite(ckpt, key, None)
    with pytest.raises(ModelDirError, match=key.replace(".", r"\.")):
        load_shard(ckpt)


def test_missing_last_mtp_expert_is_named(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=True)
    rewrite(ckpt, "mtp.layers.0.mlp.experts.3.down_proj.weight", None)
    with pytest.raises(ModelDirError, match=r"experts\.3\.down_proj"):
        load_shard(ckpt)


def test_missing_layer_tensor_is_named(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=False)
    rewrite(ckpt, "model.language_model.layers.2.linear_attn.in_proj_z.weight", None)
    with pytest.raises(ModelDirError, match=r"layers\.2\.linear_attn\.in_proj_z\.weight"):
        load_shard(ckpt)
    load_shard(ckpt, spec(3, 4, 4))  # a shard without that layer does not need it


def test_missing_layer_tensor_is_named_by_its_model_layer_on_a_shard(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=False)
    rewrite(ckpt, "model.language_model.layers.2.linear_attn.in_proj_z.weight", None)
    with pytest.raises(ModelDirError, match=r"layers\.2\.linear_attn\.in_proj_z\.weight"):
        load_shard(ckpt, ShardSpec(2, 3, is_head=False, is_tail=False))


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=False)
    key = "model.language_model.layers.1.mlp.up_proj.weight"
    rewrite(ckpt, key, mx.zeros((127, 64), dtype=mx.bfloat16))
    with pytest.raises(ModelDirError) as error:
        load_shard(ckpt)
    message = str(error.value)
    assert "layers.1.mlp.up_proj.weight" in message
    assert "(127, 64)" in message and "(128, 64)" in message


def test_declared_mtp_without_tensors_loads_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = make_checkpoint(tmp_path, moe=True, with_mtp=False)
    with caplog.at_level(logging.WARNING, logger="cluster.model.loading"):
        shard = load_shard(ckpt)
    assert not shard.has_mtp and not hasattr(shard, "mtp")
    assert any("mtp" in r.getMessage().lower() for r in caplog.records)
    assert mx.all(mx.isfinite(forward([shard]))).item()


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=False)
    edit_config(ckpt, model_type="llama")
    with pytest.raises(ModelDirError, match="'llama'"):
        load_shard(ckpt)


def test_directory_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"config\.json"):
        load_shard(tmp_path)
    with pytest.raises(ModelDirError, match=r"config\.json"):
        load_shard(tmp_path / "missing")


def test_directory_without_weights_is_a_clear_error(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, moe=False)
    for file in ckpt.glob("model*.safetensors*"):
        file.unlink()
    with pytest.raises(ModelDirError, match="safetensors"):
        load_shard(ckpt)


# -- directories converted by mlx-lm ---------------------------------------------------------


def mlx_lm_convert(src: Path, dst: Path, **options: object) -> Path:
    from mlx_lm.convert import convert

    convert(str(src), str(dst), **options)
    return dst


def test_mlx_lm_conversion_loads_without_mtp(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = make_checkpoint(tmp_path / "hf", moe=True)
    converted = mlx_lm_convert(ckpt, tmp_path / "mlx")
    with caplog.at_level(logging.WARNING, logger="cluster.model.loading"):
        shard = load_shard(converted)
    assert not shard.has_mtp and any("mtp" in r.getMessage() for r in caplog.records)
    reference = load_shard(ckpt, mtp=False)
    assert mx.array_equal(forward([shard]), forward([reference]))


def test_mixed_precision_overrides_apply_to_their_own_layers(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "hf", moe=False, num_layers=8)
    converted = mlx_lm_convert(
        ckpt, tmp_path / "mlx", quantize=True, quant_predicate="mixed_4_6"
    )  # layers 0, 3, 6, 7 get 6-bit down_proj / v_proj, the others 4-bit
    config = json.loads((converted / "config.json").read_text())
    # The same map, its layers listed last to first (as any JSON tool may reorder it).
    entries = list(config["quantization"].items())
    config["quantization"] = dict(entries[:3] + entries[3:][::-1])
    (converted / "config.json").write_text(json.dumps(config))
    load_shard(converted, spec(4, 8, 8))
