"""A random-weight checkpoint at a real model's shape, for speed: `gpu_bench` and
`mtp_depth_bench` measure on it where no real checkpoint can be downloaded.

It is written in the MLX layout and quantized like an MLX-converted model (`mtp.fc` and the
norms unquantized, as `cluster convert` leaves them), with its `mtp.*` tensors and a synthetic
word-level tokenizer of the full vocabulary, one layer at a time (memory: one layer plus the
embedding). `cluster.model.loading.load_shard` and `mlx_lm.load` both read it.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from cluster.config import ModelConfig, load_model_config
from cluster.model.convert import mlx_name
from cluster.model.shard import ModelShard, ShardSpec

ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3.5-27B (text): mlx-lm's TextModelArgs field names.
    "qwen3_5_27b": {
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "full_attention_interval": 4,
        "intermediate_size": 17408,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rope_parameters": {**ROPE, "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
    # The bundled model's shape with a larger vocabulary: a CPU smoke run of every phase.
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 4096,
        "max_position_embeddings": 8192,
        "rope_parameters": {**ROPE, "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    },
}
MARKER = "bench_checkpoint.json"


def model_config(shape: str, bits: int, group_size: int) -> dict[str, Any]:
    text = dict(SHAPES[shape])
    layers, interval = text["num_hidden_layers"], text["full_attention_interval"]
    text.update(
        model_type="qwen3_5_text",
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        dtype="bfloat16",
        eos_token_id=text["vocab_size"] - 1,
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
    )
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "eos_token_id": text["eos_token_id"],
    }
    if bits < 16:
        q = {"group_size": group_size, "bits": bits, "mode": "affine"}
        config["quantization"] = q
        config["quantization_config"] = q
    return config


# Each message in role markers, as a real template does: the coordinator's chat endpoint and
# its conversation cache (which stores the system prompt's end) work as on a real model.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level tokenizer without merges: text encodes to one id per byte (0-255), so
    distinct texts are distinct prompts (a benchmark's prompts must not share a prefix,
    or the conversation cache would time itself), and the other ids decode as words "t256"
    ..., so that any sampled id decodes. With a chat template (`CHAT_TEMPLATE`). mlx-lm's
    loader wants a tokenizer; the speed of the model does not depend on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab.update({f"t{i}": i for i in range(len(alphabet), vocab_size)})
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _bf16(shard: nn.Module) -> None:
    def cast(path: str, value: mx.array) -> mx.array:
        if path.endswith("A_log") or not mx.issubdtype(value.dtype, mx.floating):
            return value
        return value.astype(mx.bfloat16)

    shard.update(tree_map_with_path(cast, shard.parameters()))


def _quantizable(group_size: int) -> Callable[[str, nn.Module], bool]:
    def predicate(path: str, module: nn.Module) -> bool:
        if not hasattr(module, "to_quantized") or path == "mtp.fc":
            return False
        return module.weight.shape[-1] % group_size == 0

    return predicate


def write_checkpoint(path: Path, shape: str, bits: int, group_size: int, seed: int) -> dict:
    """Write (or reuse) the random checkpoint; returns what was done and its size."""
    want = {"shape": shape, "bits": bits, "group_size": group_size, "seed": seed, "version": 1}
    marker = path / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return {"reused": True, "bytes": _dir_bytes(path), "seconds": 0.0}
    started = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    raw = model_config(shape, bits, group_size)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    write_tokenizer(path, raw["text_config"]["vocab_size"])
    config = load_model_config(path)
    mx.random.seed(seed)
    layers = config.num_layers
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(layers):
        spec = ShardSpec(i, i + 1, is_head=i == 0, is_tail=i == layers - 1)
        tensors = _layer_tensors(config, spec, bits, group_size)
        file_name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        mx.save_safetensors(str(path / file_name), tensors, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(tensors, file_name))
        total += sum(v.nbytes for v in tensors.values())
        del tensors
        mx.clear_cache()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    marker.write_text(json.dumps(want))
    return {"reused": False, "bytes": total, "seconds": time.perf_counter() - started}


def _layer_tensors(
    config: ModelConfig, spec: ShardSpec, bits: int, group_size: int
) -> dict[str, mx.array]:
    """One decoder layer (plus the head's or the tail's extras), randomly initialised by the
    modules' own initialisers, cast to bf16 and quantized."""
    shard = ModelShard(config, spec, with_mtp=spec.is_tail and config.mtp_layers > 0)
    _bf16(shard)
    if bits < 16:
        nn.quantize(
            shard, group_size=group_size, bits=bits, class_predicate=_quantizable(group_size)
        )
    tensors = {
        mlx_name(name, spec): value
        for name, value in tree_flatten(shard.parameters())
        if spec.is_head or not name.startswith("embed_tokens.")  # the tail's copy
    }
    mx.eval(list(tensors.values()))
    return tensors


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def default_dir(shape: str, bits: int) -> Path:
    """tmpfs when it has room for the checkpoint twice over, else the temp dir."""
    shm = Path("/dev/shm")
    need = {"qwen3_5_27b": 40 << 30}.get(shape, 1 << 30)
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need else Path("/tmp")
    return base / f"gpu-bench-{shape}-q{bits}"


def is_random_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def bench_prompt(vocab: int, length: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(length))
