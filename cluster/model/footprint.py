"""How many bytes a model needs, per layer and per request, read without loading a tensor.

Placement must run on the coordinator before any node has loaded anything, and on a machine
that may not have the memory for the model at all. So the footprint comes from the
safetensors headers (8 bytes of little-endian header length, then a JSON table of
dtype/shape/offsets per tensor) and from config.json, never from the tensors themselves.

Both weight layouts are understood: the raw Hugging Face one (`model.language_model.*`,
`lm_head.*`, top-level `mtp.*`) and the MLX-converted one (`language_model.model.*`,
`language_model.lm_head.*`); quantized `.scales` / `.biases` count with their weight. Keys
that no node loads (a vision tower, for instance) are kept apart in `other_bytes` so that
the parts still add up to the checkpoint's size.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_RECURRENT_STATE_BYTES = 4  # the GatedDeltaNet recurrent state is kept in float32
# A config without max_position_embeddings serves what mlx-lm's TextModelArgs assumes.
_DEFAULT_MAX_CONTEXT = 131072
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors caps its header well below this

_PREFIXES = r"(?:model\.language_model|language_model\.model|model)"
_LAYER_KEY = re.compile(rf"^{_PREFIXES}\.layers\.(\d+)\.")
_EMBED_KEY = re.compile(rf"^{_PREFIXES}\.embed_tokens\.")
_NORM_KEY = re.compile(rf"^{_PREFIXES}\.norm\.")
_LM_HEAD_KEY = re.compile(r"^(?:language_model\.)?lm_head\.")
_MTP_KEY = re.compile(r"^(?:(?:model|language_model)\.)?mtp\.")


class FootprintError(ValueError):
    """A model directory whose size cannot be worked out (names the file or field at fault)."""


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """The bytes a model needs, split the way placement splits the model.

    Weights are per decoder layer plus the extras of the head (embed_tokens) and of the tail
    (final norm, lm_head, MTP head and the MTP head's own copy of embed_tokens). Caches are
    per token for each full-attention layer (K and V) and per request for each GatedDeltaNet
    layer (conv + recurrent state), because that is how they grow.
    """

    path: Path
    model_type: str
    layer_weight_bytes: tuple[int, ...]
    layer_is_attention: tuple[bool, ...]
    embed_bytes: int
    lm_head_bytes: int  # 0 when the embedding is tied
    final_norm_bytes: int
    mtp_bytes: int  # every `mtp.*` tensor; 0 when the checkpoint has no MTP head
    other_bytes: int  # tensors no node loads (vision tower, ...)
    tie_word_embeddings: bool
    kv_bytes_per_token: int  # one full-attention layer, one token: K and V
    gdn_state_bytes: int  # one GatedDeltaNet layer, one request: conv + recurrent state
    mtp_layers: int  # full-attention layers of the MTP head, each with a KV cache on the tail

    def __post_init__(self) -> None:
        if len(self.layer_weight_bytes) != len(self.layer_is_attention):
            raise FootprintError("layer_weight_bytes and layer_is_attention differ in length")
        if not self.layer_weight_bytes:
            raise FootprintError(f"{self.path}: the model has no decoder layers")
        sizes = (*self.layer_weight_bytes, self.embed_bytes, self.lm_head_bytes, self.mtp_bytes)
        if min(sizes) < 0 or min(self.kv_bytes_per_token, self.gdn_state_bytes) < 0:
            raise FootprintError(f"{self.path}: negative byte counts")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelFootprint:
        """Read config.json and the safetensors headers of `model_dir`."""
        path = Path(model_dir)
        config = _read_config(path)
        field = _ConfigFields(config, path / "config.json")
        num_layers = field.require("num_hidden_layers")
        parts = _classify(_tensor_bytes(path), num_layers, path)
        tied = bool(field("tie_word_embeddings", False))
        has_mtp = parts.mtp > 0
        return cls(
            path=path,
            model_type=config["model_type"],
            layer_weight_bytes=tuple(parts.layers),
            layer_is_attention=_attention_layers(field, num_layers, path),
            embed_bytes=parts.embed,
            lm_head_bytes=parts.lm_head,
            final_norm_bytes=parts.norm,
            mtp_bytes=parts.mtp,
            other_bytes=parts.other,
            tie_word_embeddings=tied,
            kv_bytes_per_token=_kv_bytes_per_token(field),
            gdn_state_bytes=_gdn_state_bytes(field),
            mtp_layers=int(field("mtp_num_hidden_layers", 1) or 0) if has_mtp else 0,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_weight_bytes)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.layer_is_attention) if a)

    @property
    def has_mtp(self) -> bool:
        return self.mtp_bytes > 0

    @property
    def tail_needs_embedding(self) -> bool:
        """The tail holds embed_tokens as its lm_head (tied) or as the MTP head's input."""
        return self.tie_word_embeddings or self.has_mtp

    @property
    def head_extra_bytes(self) -> int:
        return self.embed_bytes

    @property
    def tail_extra_bytes(self) -> int:
        embed = self.embed_bytes if self.tail_needs_embedding else 0
        return self.final_norm_bytes + self.lm_head_bytes + self.mtp_bytes + embed

    @property
    def tail_read_bytes(self) -> int:
        """Tail-extra bytes streamed per decode step: the embedding lookup is a gather, but
        lm_head (or the tied embedding used as one) and the MTP layer are read whole."""
        lm_head = self.embed_bytes if self.tie_word_embeddings else self.lm_head_bytes
        return self.final_norm_bytes + lm_head + self.mtp_bytes

    @property
    def total_bytes(self) -> int:
        """Every tensor of the checkpoint once: what the index calls total_size."""
        return (
            sum(self.layer_weight_bytes)
            + self.embed_bytes
            + self.lm_head_bytes
            + self.final_norm_bytes
            + self.mtp_bytes
            + self.other_bytes
        )

    def extra_bytes(self, *, is_head: bool, is_tail: bool) -> int:
        """Non-layer weights of a stage; a single-node stage holds embed_tokens only once."""
        extra = (self.head_extra_bytes if is_head else 0) + (
            self.tail_extra_bytes if is_tail else 0
        )
        if is_head and is_tail and self.tail_needs_embedding:
            extra -= self.embed_bytes
        return extra

    def layer_cache_bytes(self, layer: int, *, context_tokens: int, concurrency: int) -> int:
        """The cache one layer holds for `concurrency` requests of `context_tokens` each."""
        if self.layer_is_attention[layer]:
            return self.kv_bytes_per_token * context_tokens * concurrency
        return self.gdn_state_bytes * concurrency

    def mtp_cache_bytes(self, *, context_tokens: int, concurrency: int) -> int:
        """The MTP head's own KV cache, held by the tail."""
        return self.mtp_layers * self.kv_bytes_per_token * context_tokens * concurrency


def model_max_context(model_dir: str | Path) -> int:
    """The longest context the model was trained for (`max_position_embeddings`, as
    `cluster.config.ModelConfig.max_context` reads it), from config.json alone."""
    path = Path(model_dir)
    field = _ConfigFields(_read_config(path), path / "config.json")
    if field("max_position_embeddings") is None:
        return _DEFAULT_MAX_CONTEXT
    return field.require("max_position_embeddings")


class _ConfigFields:
    """config.json's fields, read from text_config first and from the top level second."""

    def __init__(self, config: dict[str, Any], where: Path) -> None:
        self._text = config.get("text_config") or {}
        self._config = config
        self._where = where

    def __call__(self, name: str, default: Any = None) -> Any:
        return self._text.get(name, self._config.get(name, default))

    def require(self, name: str) -> int:
        value = self(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise FootprintError(f"{self._where}: {name} must be a positive integer, got {value!r}")
        return value


@dataclass(slots=True)
class _Parts:
    layers: list[int]
    embed: int = 0
    lm_head: int = 0
    norm: int = 0
    mtp: int = 0
    other: int = 0


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FootprintError(f"{path} is not a model directory: {config_file} is missing")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise FootprintError(f"{config_file} is not valid JSON: {e}") from e
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise FootprintError(
            f"unsupported model_type {model_type!r} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint: those the index names, or the single file."""
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise FootprintError(f"{index_file} has no readable weight_map: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise FootprintError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    for file in files:
        if not file.is_file():
            raise FootprintError(f"{file} is named by {INDEX_FILE} but missing")
    return files


def _tensor_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> bytes, over every file of the checkpoint."""
    sizes: dict[str, int] = {}
    for file in _weight_files(path):
        sizes.update(read_safetensors_header_sizes(file))
    return sizes


def read_safetensors_header_sizes(file: Path) -> dict[str, int]:
    """Tensor name -> bytes of one safetensors file, from its header alone."""
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise FootprintError(f"{file} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES:
            raise FootprintError(f"{file}: implausible safetensors header of {header_len} bytes")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FootprintError(f"{file}: unreadable safetensors header: {e}") from e
    sizes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if end < begin:
            raise FootprintError(f"{file}: tensor {name} has offsets {begin}..{end}")
        sizes[name] = end - begin
    return sizes


def _classify(sizes: dict[str, int], num_layers: int, path: Path) -> _Parts:
    parts = _Parts(layers=[0] * num_layers)
    seen = [False] * num_layers
    for name, size in sizes.items():
        if match := _LAYER_KEY.match(name):
            layer = int(match.group(1))
            if layer >= num_layers:
                raise FootprintError(
                    f"{path}: tensor {name} is beyond num_hidden_layers={num_layers}"
                )
            parts.layers[layer] += size
            seen[layer] = True
        elif _MTP_KEY.match(name):
            parts.mtp += size
        elif _EMBED_KEY.match(name):
            parts.embed += size
        elif _NORM_KEY.match(name):
            parts.norm += size
        elif _LM_HEAD_KEY.match(name):
            parts.lm_head += size
        else:
            parts.other += size
    if missing := [i for i, s in enumerate(seen) if not s]:
        raise FootprintError(f"{path}: no tensors for decoder layers {missing}")
    if parts.embed == 0:
        raise FootprintError(f"{path}: no embed_tokens tensor")
    return parts


def _attention_layers(field: _ConfigFields, num_layers: int, path: Path) -> tuple[bool, ...]:
    """text_config.layer_types when present, else every full_attention_interval-th layer."""
    layer_types = field("layer_types")
    if layer_types is None:
        interval = (
            field.require("full_attention_interval") if field("full_attention_interval") else 4
        )
        return tuple((i + 1) % interval == 0 for i in range(num_layers))
    if len(layer_types) != num_layers:
        raise FootprintError(
            f"{path}: layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    return tuple(t == "full_attention" for t in layer_types)


def _activation_bytes(field: _ConfigFields) -> int:
    """Bytes per cached activation element: the model's compute dtype (bf16 unless told)."""
    dtype = field("dtype") or field("torch_dtype") or "bfloat16"
    if dtype not in _DTYPE_BYTES:
        raise FootprintError(f"unknown dtype {dtype!r} in config.json")
    return _DTYPE_BYTES[dtype]


def _kv_bytes_per_token(field: _ConfigFields) -> int:
    if field("head_dim"):
        head_dim = field.require("head_dim")
    else:
        head_dim = field.require("hidden_size") // field.require("num_attention_heads")
    return 2 * field.require("num_key_value_heads") * head_dim * _activation_bytes(field)


def _gdn_state_bytes(field: _ConfigFields) -> int:
    key_heads, key_dim = field.require("linear_num_key_heads"), field.require("linear_key_head_dim")
    value_heads = field.require("linear_num_value_heads")
    value_dim = field.require("linear_value_head_dim")
    conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
    kernel = field.require("linear_conv_kernel_dim")
    conv = (kernel - 1) * conv_channels * _activation_bytes(field)
    recurrent = value_heads * value_dim * key_dim * _RECURRENT_STATE_BYTES
    return conv + recurrent
