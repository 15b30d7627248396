"""Small random-weight Qwen3.5 checkpoints in the raw Hugging Face layout, as releases ship them.

`make_checkpoint` writes what a real release holds: config.json with a `text_config`, keys
`model.language_model.*`, `lm_head.weight` (absent when tied) and top-level `mtp.*`, RMSNorm
weights stored as (weight - 1), conv1d as [channels, 1, kernel], MoE experts fused as
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I], and the MTP layer's experts
one tensor per expert (Qwen3.5) or fused like the backbone's (Qwen3.6); two bf16 safetensors
shards with an index; the bundled model's tokenizer (so the vocabulary is its 8192 tokens).

Weights are deterministic in `seed` (the two MTP-expert layouts of one seed hold the same
model) and scaled so that activations stay sane (std 0.02, A_log = log(uniform(1, 16)),
dt_bias ones). Writing one takes a few tens of milliseconds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np

from cluster.config import bundled_model_path

HIDDEN = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
LINEAR_K_HEADS, LINEAR_V_HEADS, LINEAR_DIM = 2, 4, 16
CONV_KERNEL = 4
INTERMEDIATE = 128
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE, SHARED_INTERMEDIATE = 4, 2, 64, 64
VOCAB = 8192  # the bundled model's, so that its tokenizer fits
FULL_ATTENTION_INTERVAL = 4
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)

MTPExperts = Literal["per_expert", "fused"]


def make_checkpoint(
    dir: Path,
    *,
    moe: bool,
    mtp_experts: MTPExperts = "per_expert",
    tie_word_embeddings: bool = False,
    with_mtp: bool = True,
    num_layers: int = 4,
    seed: int = 0,
) -> Path:
    """Write the checkpoint into `dir` (created if needed) and return `dir`.

    The config always declares one MTP layer; `with_mtp=False` leaves out the `mtp.*` tensors
    (as mlx-lm's own conversion does).
    """
    if mtp_experts not in ("per_expert", "fused"):
        raise ValueError(f"mtp_experts must be 'per_expert' or 'fused', got {mtp_experts!r}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    rng = _Random(np.random.default_rng(seed))
    tensors = dict(_tensors(rng, moe, mtp_experts, tie_word_embeddings, with_mtp, num_layers))
    _save_two_shards(dir, {k: mx.array(v).astype(mx.bfloat16) for k, v in tensors.items()})
    config = _config(moe, tie_word_embeddings, num_layers)
    (dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED_FILES:
        shutil.copyfile(bundled_model_path() / name, dir / name)
    return dir


def _config(moe: bool, tied: bool, num_layers: int) -> dict:
    bundled = json.loads((bundled_model_path() / "config.json").read_text())
    text = dict(bundled["text_config"])
    text.update(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_conv_kernel_dim=CONV_KERNEL,
        linear_key_head_dim=LINEAR_DIM,
        linear_value_head_dim=LINEAR_DIM,
        linear_num_key_heads=LINEAR_K_HEADS,
        linear_num_value_heads=LINEAR_V_HEADS,
        full_attention_interval=FULL_ATTENTION_INTERVAL,
        layer_types=[
            "linear_attention" if _is_linear(i) else "full_attention" for i in range(num_layers)
        ],
        tie_word_embeddings=tied,
        mtp_num_hidden_layers=1,
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
    )
    if moe:
        del text["intermediate_size"]
        text.update(
            num_experts=EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            shared_expert_intermediate_size=SHARED_INTERMEDIATE,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
        )
    return {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": tied,
        "dtype": "bfloat16",
    }


def _is_linear(layer: int) -> bool:
    return (layer + 1) % FULL_ATTENTION_INTERVAL != 0


class _Random:
    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def normal(self, *shape: int, std: float = 0.02) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * std

    def shifted_norm(self, size: int) -> np.ndarray:
        """An RMSNorm weight as Hugging Face stores it: (weight - 1), small values around 0."""
        return self.normal(size, std=0.05)

    def a_log(self, size: int) -> np.ndarray:
        return np.log(self.rng.uniform(1, 16, size)).astype(np.float32)


def _tensors(
    rng: _Random,
    moe: bool,
    mtp_experts: MTPExperts,
    tied: bool,
    with_mtp: bool,
    num_layers: int,
) -> Iterator[tuple[str, np.ndarray]]:
    normal, shifted_norm = rng.normal, rng.shifted_norm

    def layer(prefix: str, linear: bool, fused_experts: bool) -> Iterator[tuple[str, np.ndarray]]:
        yield f"{prefix}.input_layernorm.weight", shifted_norm(HIDDEN)
        yield f"{prefix}.post_attention_layernorm.weight", shifted_norm(HIDDEN)
        if linear:
            yield from _gated_delta_net(f"{prefix}.linear_attn", rng)
        else:
            yield from _attention(f"{prefix}.self_attn", rng)
        if moe:
            yield from _moe(f"{prefix}.mlp", rng, fused_experts)
        else:
            yield from _mlp(f"{prefix}.mlp", INTERMEDIATE, rng)

    yield "model.language_model.embed_tokens.weight", normal(VOCAB, HIDDEN)
    for i in range(num_layers):
        yield from layer(f"model.language_model.layers.{i}", _is_linear(i), fused_experts=True)
    yield "model.language_model.norm.weight", shifted_norm(HIDDEN)
    if not tied:
        yield "lm_head.weight", normal(VOCAB, HIDDEN)
    if with_mtp:
        yield "mtp.fc.weight", normal(HIDDEN, 2 * HIDDEN)
        yield "mtp.pre_fc_norm_embedding.weight", shifted_norm(HIDDEN)
        yield "mtp.pre_fc_norm_hidden.weight", shifted_norm(HIDDEN)
        yield from layer("mtp.layers.0", linear=False, fused_experts=mtp_experts == "fused")
        yield "mtp.norm.weight", shifted_norm(HIDDEN)


def _gated_delta_net(prefix: str, rng: _Random) -> Iterator[tuple[str, np.ndarray]]:
    normal = rng.normal
    key_dim, value_dim = LINEAR_K_HEADS * LINEAR_DIM, LINEAR_V_HEADS * LINEAR_DIM
    conv_dim = 2 * key_dim + value_dim
    yield f"{prefix}.in_proj_qkv.weight", normal(conv_dim, HIDDEN)
    yield f"{prefix}.in_proj_z.weight", normal(value_dim, HIDDEN)
    yield f"{prefix}.in_proj_a.weight", normal(LINEAR_V_HEADS, HIDDEN)
    yield f"{prefix}.in_proj_b.weight", normal(LINEAR_V_HEADS, HIDDEN)
    yield f"{prefix}.conv1d.weight", normal(conv_dim, 1, CONV_KERNEL, std=0.3)
    yield f"{prefix}.A_log", rng.a_log(LINEAR_V_HEADS)
    yield f"{prefix}.dt_bias", np.ones(LINEAR_V_HEADS, dtype=np.float32)
    yield f"{prefix}.norm.weight", 1 + normal(LINEAR_DIM, std=0.05)  # stored as is
    yield f"{prefix}.out_proj.weight", normal(HIDDEN, value_dim)


def _attention(prefix: str, rng: _Random) -> Iterator[tuple[str, np.ndarray]]:
    normal, shifted_norm = rng.normal, rng.shifted_norm
    yield f"{prefix}.q_proj.weight", normal(2 * HEADS * HEAD_DIM, HIDDEN)  # queries + gate
    yield f"{prefix}.k_proj.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN)
    yield f"{prefix}.v_proj.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN)
    yield f"{prefix}.o_proj.weight", normal(HIDDEN, HEADS * HEAD_DIM)
    yield f"{prefix}.q_norm.weight", shifted_norm(HEAD_DIM)
    yield f"{prefix}.k_norm.weight", shifted_norm(HEAD_DIM)


def _mlp(prefix: str, intermediate: int, rng: _Random) -> Iterator[tuple[str, np.ndarray]]:
    normal = rng.normal
    yield f"{prefix}.gate_proj.weight", normal(intermediate, HIDDEN)
    yield f"{prefix}.up_proj.weight", normal(intermediate, HIDDEN)
    yield f"{prefix}.down_proj.weight", normal(HIDDEN, intermediate)


def _moe(prefix: str, rng: _Random, fused: bool) -> Iterator[tuple[str, np.ndarray]]:
    normal = rng.normal
    yield f"{prefix}.gate.weight", normal(EXPERTS, HIDDEN, std=0.2)  # a router with preferences
    # Drawn fused in both layouts, so that the two layouts of one seed hold the same model.
    gate_up = normal(EXPERTS, 2 * EXPERT_INTERMEDIATE, HIDDEN)
    down = normal(EXPERTS, HIDDEN, EXPERT_INTERMEDIATE)
    if fused:
        yield f"{prefix}.experts.gate_up_proj", gate_up
        yield f"{prefix}.experts.down_proj", down
    else:
        for e in range(EXPERTS):
            yield f"{prefix}.experts.{e}.gate_proj.weight", gate_up[e, :EXPERT_INTERMEDIATE]
            yield f"{prefix}.experts.{e}.up_proj.weight", gate_up[e, EXPERT_INTERMEDIATE:]
            yield f"{prefix}.experts.{e}.down_proj.weight", down[e]
    yield from _mlp(f"{prefix}.shared_expert", SHARED_INTERMEDIATE, rng)
    yield f"{prefix}.shared_expert_gate.weight", normal(1, HIDDEN)


def _save_two_shards(dir: Path, tensors: dict[str, mx.array]) -> None:
    """Split in key order at half the bytes, like a release's `model-0000k-of-00002`."""
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    total = sum(v.nbytes for v in tensors.values())
    shards: list[dict[str, mx.array]] = [{}, {}]
    written = 0
    for key, value in tensors.items():
        shards[0 if written < total // 2 else 1][key] = value
        written += value.nbytes
    for name, shard in zip(names, shards, strict=True):
        mx.save_safetensors(str(dir / name), shard, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": total},
        "weight_map": {key: names[i] for i, shard in enumerate(shards) for key in sorted(shard)},
    }
    (dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_noise_copy(dir: Path, source: Path | None = None, seed: int = 0) -> Path:
    """A copy of `source` (the bundled model by default) with every tensor replaced by noise
    of the same scale: each tensor's elements drawn from a normal of its own mean and standard
    deviation. The shapes, the config and the tokenizer stay, so it runs exactly like the
    source; what it learned is gone, so its MTP head's drafts are (practically) never
    accepted: the worst case for drafting."""
    source = Path(source) if source is not None else bundled_model_path()
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for file in sorted(source.iterdir()):
        if file.suffix != ".safetensors":
            if file.is_file():
                shutil.copyfile(file, dir / file.name)
            continue
        tensors = {}
        for key, value in mx.load(str(file)).items():
            array = np.array(value.astype(mx.float32))
            noise = rng.standard_normal(array.shape, dtype=np.float32)
            noise = noise * array.std() + array.mean()
            tensors[key] = mx.array(noise).astype(value.dtype)
        mx.save_safetensors(str(dir / file.name), tensors, metadata={"format": "pt"})
    return dir
