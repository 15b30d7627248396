"""ModelFootprint from safetensors headers: the bundled model, both layouts, and bad directories."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from cluster.config import bundled_model_path
from cluster.model.footprint import (
    FootprintError,
    ModelFootprint,
    model_max_context,
    read_safetensors_header_sizes,
)

TEXT_CONFIG = {
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "mtp_num_hidden_layers": 1,
}


def write_safetensors(path: Path, sizes: dict[str, int]) -> None:
    """A safetensors file whose tensors are uint8 vectors of the given sizes (zeros)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, size in sizes.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def write_model(
    path: Path,
    shards: dict[str, dict[str, int]],
    *,
    config: dict | None = None,
    index: bool = True,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = config or {"model_type": "qwen3_5", "text_config": TEXT_CONFIG}
    (path / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for file, sizes in shards.items():
        write_safetensors(path / file, sizes)
        weight_map.update(dict.fromkeys(sizes, file))
    if index:
        total = sum(sum(s.values()) for s in shards.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    return path


def hf_tensors(layers: int = 4) -> dict[str, int]:
    tensors = {"model.language_model.embed_tokens.weight": 1000, "lm_head.weight": 1000}
    for i in range(layers):
        tensors[f"model.language_model.layers.{i}.mlp.up_proj.weight"] = 100 + i
        tensors[f"model.language_model.layers.{i}.input_layernorm.weight"] = 10
    tensors["model.language_model.norm.weight"] = 7
    tensors["mtp.fc.weight"] = 50
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = 60
    return tensors


@pytest.fixture(scope="module")
def bundled() -> ModelFootprint:
    return ModelFootprint.from_dir(bundled_model_path())


def test_bundled_model_layers_and_attention(bundled: ModelFootprint) -> None:
    assert bundled.model_type == "qwen3_5"
    assert bundled.num_layers == 8
    assert bundled.attention_layers == (3, 7)
    assert bundled.has_mtp and bundled.mtp_layers == 1
    assert not bundled.tie_word_embeddings


def test_bundled_model_bytes_add_up_to_the_index(bundled: ModelFootprint) -> None:
    index = json.loads((bundled_model_path() / "model.safetensors.index.json").read_text())
    assert bundled.total_bytes == index["metadata"]["total_size"]
    assert bundled.other_bytes == 0
    parts = (
        sum(bundled.layer_weight_bytes)
        + bundled.embed_bytes
        + bundled.lm_head_bytes
        + bundled.final_norm_bytes
        + bundled.mtp_bytes
    )
    assert parts == index["metadata"]["total_size"]


def test_bundled_model_tensor_sizes(bundled: ModelFootprint) -> None:
    # vocab 8192 x hidden 256 in bf16
    assert bundled.embed_bytes == bundled.lm_head_bytes == 8192 * 256 * 2
    assert bundled.final_norm_bytes == 256 * 2
    # every GatedDeltaNet layer alike, every attention layer alike
    gdn = {bundled.layer_weight_bytes[i] for i in (0, 1, 2, 4, 5, 6)}
    attn = {bundled.layer_weight_bytes[i] for i in (3, 7)}
    assert len(gdn) == len(attn) == 1


def test_bundled_model_cache_sizes(bundled: ModelFootprint) -> None:
    assert bundled.kv_bytes_per_token == 2 * 2 * 64 * 2  # K and V, 2 kv heads, dim 64, bf16
    conv = (4 - 1) * (2 * 2 * 64 + 4 * 64) * 2
    recurrent = 4 * 64 * 64 * 4
    assert bundled.gdn_state_bytes == conv + recurrent
    assert bundled.layer_cache_bytes(3, context_tokens=100, concurrency=2) == 512 * 200
    assert bundled.layer_cache_bytes(0, context_tokens=100, concurrency=2) == 2 * (conv + recurrent)
    assert bundled.mtp_cache_bytes(context_tokens=100, concurrency=2) == 512 * 200


def test_head_and_tail_extras(bundled: ModelFootprint) -> None:
    b = bundled
    assert b.head_extra_bytes == b.embed_bytes
    # the tail's MTP head needs its own embed_tokens
    assert b.tail_extra_bytes == b.final_norm_bytes + b.lm_head_bytes + b.mtp_bytes + b.embed_bytes
    assert b.extra_bytes(is_head=False, is_tail=False) == 0
    # one node holding both ends keeps one embed_tokens
    assert b.extra_bytes(is_head=True, is_tail=True) == b.tail_extra_bytes
    assert b.tail_read_bytes == b.final_norm_bytes + b.lm_head_bytes + b.mtp_bytes


def test_header_reader_matches_file_sizes(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"x": 3, "y": 5})
    assert read_safetensors_header_sizes(tmp_path / "a.safetensors") == {"x": 3, "y": 5}


def test_hf_layout_synthetic(tmp_path: Path) -> None:
    tensors = hf_tensors()
    names = list(tensors)
    shards = {
        "model-1.safetensors": {n: tensors[n] for n in names[:5]},
        "model-2.safetensors": {n: tensors[n] for n in names[5:]},
    }
    fp = ModelFootprint.from_dir(write_model(tmp_path / "m", shards))
    assert fp.layer_weight_bytes == (110, 111, 112, 113)
    assert fp.layer_is_attention == (False, True, False, True)  # every 2nd, from the interval
    assert (fp.embed_bytes, fp.lm_head_bytes, fp.final_norm_bytes) == (1000, 1000, 7)
    assert fp.mtp_bytes == 110
    assert fp.total_bytes == sum(tensors.values())


def test_mlx_layout_quantized_and_tied(tmp_path: Path) -> None:
    tensors = {
        "language_model.model.embed_tokens.weight": 400,
        "language_model.model.embed_tokens.scales": 20,
        "language_model.model.embed_tokens.biases": 20,
        "language_model.model.norm.weight": 7,
        "mtp.fc.weight": 30,
        "mtp.fc.scales": 3,
        "vision_tower.blocks.0.weight": 99,  # not for any node
    }
    for i in range(4):
        for part in ("weight", "scales", "biases"):
            tensors[f"language_model.model.layers.{i}.mlp.gate_proj.{part}"] = 10
    config = {
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": True,
        "text_config": {**TEXT_CONFIG, "layer_types": ["full_attention"] + ["x"] * 3},
    }
    fp = ModelFootprint.from_dir(
        write_model(tmp_path / "m", {"model.safetensors": tensors}, config=config, index=False)
    )
    assert fp.model_type == "qwen3_5_moe"
    assert fp.layer_weight_bytes == (30, 30, 30, 30)
    assert fp.attention_layers == (0,)  # layer_types wins over the interval
    assert fp.embed_bytes == 440 and fp.lm_head_bytes == 0 and fp.tie_word_embeddings
    assert fp.mtp_bytes == 33 and fp.other_bytes == 99
    assert fp.tail_read_bytes == 7 + 440 + 33  # the tied embedding is the lm_head
    assert fp.total_bytes == sum(tensors.values())


def test_fields_at_top_level(tmp_path: Path) -> None:
    config = {"model_type": "qwen3_5", **TEXT_CONFIG, "torch_dtype": "float32"}
    fp = ModelFootprint.from_dir(
        write_model(tmp_path / "m", {"m.safetensors": hf_tensors()}, config=config)
    )
    assert fp.kv_bytes_per_token == 2 * 2 * 8 * 4


def test_no_mtp_untied_tail_needs_no_embedding(tmp_path: Path) -> None:
    tensors = {k: v for k, v in hf_tensors().items() if not k.startswith("mtp.")}
    fp = ModelFootprint.from_dir(write_model(tmp_path / "m", {"m.safetensors": tensors}))
    assert not fp.has_mtp and fp.mtp_layers == 0
    assert fp.tail_extra_bytes == fp.final_norm_bytes + fp.lm_head_bytes


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    config = {"model_type": "llama", "text_config": TEXT_CONFIG}
    path = write_model(tmp_path / "m", {"m.safetensors": hf_tensors()}, config=config)
    with pytest.raises(FootprintError, match="'llama'"):
        ModelFootprint.from_dir(path)


def test_missing_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(FootprintError, match=r"config\.json"):
        ModelFootprint.from_dir(tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", {"model-1.safetensors": hf_tensors()})
    (path / "model-1.safetensors").unlink()
    with pytest.raises(FootprintError, match=r"model-1\.safetensors"):
        ModelFootprint.from_dir(path)


def test_missing_index_and_file_are_named(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", {"x.safetensors": hf_tensors()}, index=False)
    with pytest.raises(FootprintError, match=r"model\.safetensors\.index\.json"):
        ModelFootprint.from_dir(path)


def test_missing_layer_is_reported(tmp_path: Path) -> None:
    tensors = {k: v for k, v in hf_tensors().items() if ".layers.2." not in k}
    path = write_model(tmp_path / "m", {"m.safetensors": tensors})
    with pytest.raises(FootprintError, match=r"decoder layers \[2\]"):
        ModelFootprint.from_dir(path)


def test_missing_config_field_is_named(tmp_path: Path) -> None:
    text = {k: v for k, v in TEXT_CONFIG.items() if k != "num_key_value_heads"}
    config = {"model_type": "qwen3_5", "text_config": text}
    path = write_model(tmp_path / "m", {"m.safetensors": hf_tensors()}, config=config)
    with pytest.raises(FootprintError, match="num_key_value_heads"):
        ModelFootprint.from_dir(path)


def test_max_context_from_the_config(tmp_path: Path) -> None:
    text = {**TEXT_CONFIG, "max_position_embeddings": 4096}
    config = {"model_type": "qwen3_5", "text_config": text}
    assert (
        model_max_context(
            write_model(tmp_path / "a", {"m.safetensors": hf_tensors()}, config=config)
        )
        == 4096
    )
    # Without the field: what mlx-lm's TextModelArgs assumes, as the engine does.
    bare = {k: v for k, v in TEXT_CONFIG.items() if k != "max_position_embeddings"}
    config = {"model_type": "qwen3_5", "text_config": bare}
    path = write_model(tmp_path / "b", {"m.safetensors": hf_tensors()}, config=config)
    assert model_max_context(path) == 131072
    text = {**TEXT_CONFIG, "max_position_embeddings": "long"}
    config = {"model_type": "qwen3_5", "text_config": text}
    path = write_model(tmp_path / "c", {"m.safetensors": hf_tensors()}, config=config)
    with pytest.raises(FootprintError, match="max_position_embeddings"):
        model_max_context(path)
