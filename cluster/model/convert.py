"""`cluster convert`: a Qwen3.5 checkpoint to an MLX directory that keeps its MTP head.

The output is what mlx-lm writes (its keys, its `quantization` config, safetensors shards of at
most 5 GB with an index), so mlx-lm loads it too, plus the top-level `mtp.*` tensors that
mlx-lm's own conversion drops, in the same already-sanitized layout:

    language_model.model.embed_tokens.weight      language_model.model.norm.weight
    language_model.model.layers.{i}.<...>         language_model.lm_head.weight (untied)
    mtp.fc.weight, mtp.pre_fc_norm_*, mtp.layers.0.<...>, mtp.norm.weight

The tensors go through `cluster.model.loading.load_shard`, one decoder layer at a time: the raw
Hugging Face transform (norms shifted once, conv1d transposed, experts stacked into
`switch_mlp`) and the completeness and shape checks are the loader's own, and the memory of a
conversion is one layer plus one output file. The source may be a raw Hugging Face
checkpoint or an MLX directory (then it is re-cast or re-sharded; quantizing an already
quantized directory is refused).

Quantization (affine, `q_bits` 4 or 8) follows mlx-lm's `quantize_model`: every Linear and
Embedding whose input size the group size divides, the MoE routers (`mlp.gate`,
`shared_expert_gate`) at 8 bits as mlx-lm's `quant_predicate` does, and never norms, A_log,
dt_bias or conv1d (they are not Linear). In the MTP head, `mtp.fc` stays unquantized as well,
like the head's norms: it is the head's input projection, mixing the normalized token
embedding with the backbone's hidden state, so its error reaches every draft through the
head's one decoder layer with nothing after it to correct it; and it is small (2H x H: 13% of
the bundled model's MTP head and about as much of a dense one, under 1% of an MoE head).
Measured on the bundled model (draft acceptance, teacher-forced over 1532 positions of stdlib
code), quantizing it changed nothing beyond noise (8 bits: 0.627 kept vs 0.627 quantized;
4 bits: 0.607 vs 0.606), so either choice is defensible; keeping it is the conservative one.
`quantize_mtp_fc=True` quantizes it.

`mtp_from` grafts the MTP head of another checkpoint of the same model (the original Hugging
Face release, whose `mtp.*` mlx-lm's conversions drop) into the output: its tensors are read and
transformed as the loader reads them, cast to the output's dtype, and quantized as this
conversion quantizes (with `q_bits`, or as the source is quantized), so the result is what
converting the original would have written. Only the files that hold `mtp.*` are read (and,
for a repo id, fetched).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from cluster.config import ModelConfig, ModelDirError, load_model_config
from cluster.model import loading
from cluster.model.loading import CheckpointIndex, load_shard
from cluster.model.mtp import MTPHead
from cluster.model.shard import ModelShard, ShardSpec

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 5 << 30
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)
DTYPES = ("bfloat16", "float16", "float32")
ROUTER_QUANTIZATION = {"group_size": 64, "bits": 8}  # mlx-lm's qwen3_5 quant_predicate
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


class ConvertError(ValueError):
    """A conversion refused as asked (destination in use, options the source cannot take)."""


def convert(
    src: Path,
    dst: Path,
    *,
    q_bits: int | None = None,
    q_group_size: int = 64,
    dtype: str | None = None,
    force: bool = False,
    quantize_mtp_fc: bool = False,
    mtp_from: str | Path | None = None,
) -> Path:
    """Convert the model directory `src` into `dst` and return `dst`.

    `dtype` casts every floating tensor but A_log (default: the dtype the config declares,
    else the embedding's). `force` replaces a non-empty `dst`. `quantize_mtp_fc` quantizes
    `mtp.fc` like the other Linears (off by default: see the module docstring). `mtp_from`
    (a directory or Hugging Face repo id) gives the MTP head instead of `src`'s own.
    The output is written next to `dst` and moved into place when complete, so a failed
    conversion leaves no half-written directory behind.
    """
    src, dst = Path(src), Path(dst)
    config = load_model_config(src)
    index = CheckpointIndex.read(config.path)
    _check_options(config, q_bits, q_group_size, dtype)
    _check_destination(src, dst, force)
    target = getattr(mx, dtype) if dtype else _source_dtype(config, index)
    quantizer = Quantizer(q_bits, q_group_size, quantize_mtp_fc) if q_bits else None
    if quantizer is None and config.quantization:  # grafted tensors quantized as the source
        q = config.quantization
        quantizer = Quantizer(q.get("bits", 4), q.get("group_size", 64), quantize_mtp_fc)
        quantizer.overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
    mtp_dir = _mtp_source(config, mtp_from) if mtp_from is not None else None

    dst.parent.mkdir(parents=True, exist_ok=True)
    work = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        files = _write_weights(config, work, target, quantizer, mtp_dir)
        quantization = quantizer.config() if quantizer else config.quantization
        _write_config(config, work / "config.json", target, quantization, mtp_dir)
        for name in COPIED_FILES:
            if (config.path / name).is_file():
                shutil.copyfile(config.path / name, work / name)
        if dst.exists():
            shutil.rmtree(dst)
        work.rename(dst)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("converted %s to %s (%d safetensors files)", src, dst, files)
    return dst


def _write_weights(
    config: ModelConfig,
    out: Path,
    dtype: mx.Dtype,
    quantizer: Quantizer | None,
    mtp_dir: Path | None = None,
) -> int:
    """Load, cast, quantize and write one decoder layer at a time, then the MTP head of
    `mtp_dir` when given (in place of the source's own); returns the file count. A source
    quantized already is written as it is (`quantizer` then serves the graft only)."""
    writer = ShardWriter(out)
    requantize = quantizer is not None and not config.quantization
    for spec in _layer_specs(config.num_layers):
        shard = load_shard(config.path, spec, mtp=mtp_dir is None)
        _cast(shard, dtype)
        if requantize:
            quantizer.apply(shard)
        for name, value in tree_flatten(shard.parameters()):
            if name.startswith("embed_tokens.") and not spec.is_head:
                continue  # the tail's copy of the head's embedding
            writer.add(mlx_name(name, spec), value)
        del shard
    if mtp_dir is not None:
        head = _MTPOnly(mtp_dir, config.num_layers)
        _cast(head, dtype)
        if quantizer:
            quantizer.apply(head)
        for name, value in tree_flatten(head.parameters()):
            writer.add(name, value)
    writer.finish()
    return len(writer.files)


def _mtp_source(config: ModelConfig, mtp_from: str | Path) -> Path:
    """The directory of the MTP head to graft (a repo id fetched as far as its `mtp.*` files),
    checked to be an unquantized head of this very model."""
    from cluster.hub import resolve_mtp_source

    try:
        source = load_model_config(resolve_mtp_source(mtp_from))
    except ModelDirError as error:
        raise ConvertError(f"--mtp-from {mtp_from}: {error}") from None
    if source.mtp_layers < 1 or not CheckpointIndex.read(source.path).has_mtp:
        raise ConvertError(f"--mtp-from {mtp_from}: it has no mtp.* tensors to graft")
    if source.quantization or source.raw.get("quantization_config"):
        raise ConvertError(
            f"--mtp-from {mtp_from} is quantized: graft from the original (unquantized) release"
        )
    shape = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size")  # fmt: skip
    for name in shape:
        if getattr(source.text, name, None) != getattr(config.text, name, None):
            raise ConvertError(
                f"--mtp-from {mtp_from} is another model than {config.path}: {name} "
                f"{getattr(source.text, name, None)} vs {getattr(config.text, name, None)}"
            )
    return source.path


class _MTPOnly(nn.Module):
    """The MTP head of the model in `path`, alone, its tensors read and transformed as the
    loader reads a tail's (`cluster.model.loading`), under the names a shard gives them."""

    def __init__(self, path: Path, num_layers: int):
        super().__init__()
        config = load_model_config(path)
        self.spec = ShardSpec(num_layers - 1, num_layers, is_head=False, is_tail=True)
        self.mtp = MTPHead(config.text, config.mtp_layers)
        wanted = dict(tree_flatten(self.parameters()))
        index = CheckpointIndex.read(config.path)
        weights = loading._read_weights(index, self.spec, set(wanted), config)
        weights = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        loading._check_complete(wanted, weights, config.path, self.spec)
        self.load_weights(list(weights.items()), strict=True)


def mlx_name(name: str, spec: ShardSpec) -> str:
    """A parameter (or module) path of a shard to its path in an MLX directory."""
    if match := _LAYER.match(name):
        return f"language_model.model.layers.{int(match.group(1)) + spec.start}.{match.group(2)}"
    if name.startswith(("embed_tokens", "norm")):
        return f"language_model.model.{name}"
    if name.startswith("lm_head"):
        return f"language_model.{name}"
    return name  # mtp.*: already the shard's path


def _layer_specs(num_layers: int) -> Iterator[ShardSpec]:
    """One shard per decoder layer: the head brings the embedding, the tail the final norm,
    lm_head and MTP head."""
    for i in range(num_layers):
        yield ShardSpec(i, i + 1, is_head=i == 0, is_tail=i == num_layers - 1)


@dataclass(slots=True)
class Quantizer:
    """mlx-lm's quantization choices, recorded as mlx-lm records them in `quantization`."""

    bits: int
    group_size: int
    quantize_mtp_fc: bool = False
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def apply(self, shard: ModelShard) -> None:
        nn.quantize(
            shard,
            group_size=self.group_size,
            bits=self.bits,
            mode="affine",
            class_predicate=lambda path, module: self._choose(path, module, shard.spec),
        )

    def _choose(self, path: str, module: nn.Module, spec: ShardSpec) -> bool | dict:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % self.group_size:
            return False
        if path == "mtp.fc" and not self.quantize_mtp_fc:
            return False
        if path.endswith(("mlp.gate", "shared_expert_gate")):
            if module.weight.shape[-1] % ROUTER_QUANTIZATION["group_size"]:
                return False
            self.overrides[mlx_name(path, spec)] = dict(ROUTER_QUANTIZATION)
            return dict(ROUTER_QUANTIZATION)
        return True

    def config(self) -> dict[str, Any]:
        base = {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
        return base | dict(sorted(self.overrides.items()))


class ShardWriter:
    """Safetensors files of at most `max_bytes` each (a larger tensor gets a file of its
    own), then `model.safetensors.index.json`, with mlx-lm's file names."""

    def __init__(self, directory: Path, max_bytes: int | None = None):
        self.directory = directory
        self.max_bytes = max_bytes or MAX_FILE_BYTES
        self.files: list[list[str]] = []
        self.total_bytes = 0
        self._pending: dict[str, mx.array] = {}
        self._pending_bytes = 0

    def add(self, key: str, value: mx.array) -> None:
        if self._pending and self._pending_bytes + value.nbytes > self.max_bytes:
            self._flush()
        self._pending[key] = value
        self._pending_bytes += value.nbytes
        self.total_bytes += value.nbytes

    def finish(self) -> None:
        if self._pending or not self.files:
            self._flush()
        count = len(self.files)
        weight_map = {}
        for i, keys in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            if count == 1:
                name = "model.safetensors"
            (self.directory / self._part_name(i)).rename(self.directory / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))

    def _flush(self) -> None:
        path = self.directory / self._part_name(len(self.files))
        mx.save_safetensors(str(path), self._pending, metadata={"format": "mlx"})
        self.files.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    @staticmethod
    def _part_name(i: int) -> str:
        return f"part-{i:05d}.safetensors"


def _cast(shard: ModelShard, dtype: mx.Dtype) -> None:
    """Every floating parameter but A_log to `dtype` (mlx-lm's cast_predicate). This also
    undoes the loader's float32 experts on CPU, so a conversion never depends on the device."""

    def cast(path: str, value: mx.array) -> mx.array:
        if path.endswith("A_log") or not mx.issubdtype(value.dtype, mx.floating):
            return value
        return value.astype(dtype)

    shard.update(tree_map_with_path(cast, shard.parameters()))


def _source_dtype(config: ModelConfig, index: CheckpointIndex) -> mx.Dtype:
    """The dtype the config declares (as mlx-lm's convert reads it), else the embedding's."""
    text = config.raw.get("text_config", {})
    for declared in (config.raw.get("torch_dtype"), config.raw.get("dtype"), text.get("dtype")):
        if declared in DTYPES:
            return getattr(mx, declared)
    embed = next((k for k in index.files if k.endswith("embed_tokens.weight")), None)
    if embed is None:
        return mx.bfloat16  # no embedding: the loader will name what is missing
    return mx.load(str(index.path / index.files[embed]))[embed].dtype


def _write_config(
    config: ModelConfig,
    path: Path,
    dtype: mx.Dtype,
    quantization: dict[str, Any] | None,
    mtp_dir: Path | None = None,
) -> None:
    out = json.loads(json.dumps(config.raw))  # a deep copy
    if mtp_dir is not None:  # the grafted head's size, where the source's config lost it
        mtp_layers = load_model_config(mtp_dir).mtp_layers
        section = out["text_config"] if isinstance(out.get("text_config"), dict) else out
        section["mtp_num_hidden_layers"] = mtp_layers
    for key in ("_name_or_path", "vision_config", "quantization", "quantization_config"):
        out.pop(key, None)
    name = _dtype_name(dtype)
    for section in (out, out.get("text_config")):
        for key in ("torch_dtype", "dtype"):
            if isinstance(section, dict) and key in section:
                section[key] = name
    if quantization:
        out["quantization"] = quantization
        out["quantization_config"] = quantization  # mlx-lm mirrors it for HF tooling
    path.write_text(json.dumps(dict(sorted(out.items())), indent=4))


def _dtype_name(dtype: mx.Dtype) -> str:
    return next(name for name in DTYPES if getattr(mx, name) == dtype)


def _check_options(
    config: ModelConfig, q_bits: int | None, q_group_size: int, dtype: str | None
) -> None:
    if q_bits is not None and q_bits not in Q_BITS:
        raise ConvertError(f"q_bits must be one of {Q_BITS}, got {q_bits}")
    if q_group_size not in Q_GROUP_SIZES:
        raise ConvertError(f"q_group_size must be one of {Q_GROUP_SIZES}, got {q_group_size}")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    foreign = config.raw.get("quantization_config")
    if foreign and not config.quantization:
        method = foreign.get("quant_method", "unknown") if isinstance(foreign, dict) else foreign
        raise ConvertError(
            f"{config.path} is quantized by another tool ({method}); convert reads unquantized "
            "Hugging Face checkpoints and MLX directories"
        )
    if q_bits is not None and config.quantization:
        raise ConvertError(f"{config.path} is already quantized; convert it from the original")


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    source, target = src.resolve(), dst.resolve()
    if target == source or target in source.parents:
        raise ConvertError(f"the destination {dst} would overwrite the source {src}")
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"the destination {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise ConvertError(f"the destination {dst} is not empty (pass --force to replace it)")
