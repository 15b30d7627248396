"""Read one shard's weights from a model directory, and only those.

Two layouts are read:
- the raw Hugging Face layout of Qwen3.5 releases: `model.language_model.*`, `lm_head.*`,
  top-level `mtp.*`; RMSNorm weights stored as (weight - 1); conv1d as [channels, 1, kernel];
  MoE experts fused as `experts.gate_up_proj` / `experts.down_proj`, and the MTP layer's
  experts one tensor per expert (Qwen3.5) or fused (Qwen3.6);
- an MLX directory (mlx-lm's or `cluster convert`'s, possibly quantized): `language_model.*`
  already in mlx-lm's layout, `mtp.*` (kept by `cluster convert`) in the same layout.
The layout is told by the key prefixes of the whole directory, never by a tensor's shape, so a
norm is shifted exactly once even on a shard that holds no GatedDeltaNet layer.

Tensors are read lazily (mx.load maps them), and only the shard's ones are ever evaluated.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from cluster.config import ModelConfig, ModelDirError, load_model_config
from cluster.model import few_row_matmul, fused
from cluster.model.fast_path import DecodeFastPath
from cluster.model.layers import PackedDecoderLayer
from cluster.model.shard import ModelShard, ShardSpec

log = logging.getLogger(__name__)

# What the coordinator, `cluster generate` and `cluster status` say of a checkpoint whose config
# declares an MTP head that its weights lack (every mlx-community conversion drops `mtp.*`).
NO_MTP_HEAD = "model has no MTP head: serving without drafts"

# RMSNorms that Hugging Face stores as (weight - 1). GatedDeltaNet's own gated norm
# (`linear_attn.norm`) is stored as is.
_SHIFTED_NORMS = re.compile(
    r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|pre_fc_norm_embedding"
    r"|pre_fc_norm_hidden)\.weight$|^(mtp\.)?norm\.weight$"
)
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class MissingTensorError(ModelDirError):
    pass


@dataclass(frozen=True, slots=True)
class CheckpointIndex:
    """Where each tensor of a model directory lives, and which layout the directory uses."""

    path: Path
    files: dict[str, str]  # source key -> safetensors file name
    raw_hf: bool

    @classmethod
    def read(cls, model_dir: Path) -> CheckpointIndex:
        index_file = model_dir / "model.safetensors.index.json"
        if index_file.is_file():
            files = json.loads(index_file.read_text())["weight_map"]
        elif (model_dir / "model.safetensors").is_file():
            files = {k: "model.safetensors" for k in mx.load(str(model_dir / "model.safetensors"))}
        else:
            raise ModelDirError(f"{model_dir} has no model.safetensors(.index.json)")
        raw_hf = any(k.startswith(("model.language_model.", "model.layers.")) for k in files)
        return cls(model_dir, files, raw_hf)

    def shard_name(self, key: str) -> str | None:
        """The source key's name inside a ModelShard (before any selection), or None."""
        for prefix in ("model.language_model.", "language_model.model.", "model."):
            if key.startswith(prefix):
                return key[len(prefix) :]
        for prefix in ("lm_head.", "language_model.lm_head."):
            if key.startswith(prefix):
                return "lm_head." + key[len(prefix) :]
        if key.startswith("mtp."):
            return key
        return None  # vision tower and anything else a text shard never needs

    @property
    def has_mtp(self) -> bool:
        return any(k.startswith("mtp.") for k in self.files)


def load_shard(
    model_dir: str | Path,
    spec: ShardSpec | None = None,
    *,
    dtype: mx.Dtype | None = None,
    mtp: bool = True,
    for_decoding: bool = False,
    fast_path: DecodeFastPath | None = None,
    fill_missing: bool = False,
) -> ModelShard:
    """Build the shard for `spec` (the whole model by default) and load its tensors.

    `mtp=False` leaves the MTP head out. `for_decoding` readies a shard that runs steps (nodes,
    the local engine), not one whose parameters are written back out: the projections that
    share an input become one matmul (`cluster.model.fused`), and where `fast_path` asks for
    it (on CUDA) the quantized ones run the few-row kernel (`cluster.model.few_row_matmul`).
    The shard steps with `fast_path` (None: `DecodeFastPath.for_device()`).
    A config that declares MTP on a checkpoint without any `mtp.*` tensor (mlx-lm's own
    conversion drops them) loads without it, with a warning. `fill_missing` makes every
    parameter the directory lacks zeros, unquantized, the MTP head's too: a shard whose values
    do not matter (`cluster.decode.kernel_builds` runs one for the kernels its steps compile).
    """
    config = load_model_config(model_dir)
    index = CheckpointIndex.read(config.path)
    spec = spec or ShardSpec.whole(config.num_layers)
    with_mtp = mtp and spec.is_tail and config.mtp_layers > 0
    if with_mtp and not index.has_mtp and not fill_missing:
        log.warning(
            "%s declares %d MTP layer(s) but ships no mtp.* tensors: %s",
            config.path,
            config.mtp_layers,
            NO_MTP_HEAD,
        )
        with_mtp = False
    shard = ModelShard(config, spec, with_mtp=with_mtp, fast_path=fast_path)
    wanted = dict(tree_flatten(shard.parameters()))
    weights = _read_weights(index, spec, set(wanted), config)
    if config.quantization:
        _quantize_like_checkpoint(shard, weights, config)
        wanted = dict(tree_flatten(shard.parameters()))
    if fill_missing:
        weights |= {k: mx.zeros(v.shape, v.dtype) for k, v in wanted.items() if k not in weights}
    _check_complete(wanted, weights, config.path, spec)
    weights = {k: _cast(k, v, dtype, config) for k, v in weights.items()}
    shard.load_weights(list(weights.items()), strict=True)
    # The shard holds the only references now, so a fused projection's parts are freed once
    # read into it (held here too, they kept a load at 1.44x the shard's bytes, and a 27B
    # bf16 shard ran an 80 GB GPU out of memory).
    del weights, wanted
    if for_decoding:  # on the lazy weights: the parts are read straight into the fused arrays
        fused.fuse_projections(shard)
        if shard.fast_path.few_row_kernel and few_row_matmul.available():
            few_row_matmul.use_few_row_kernel(shard)
    shard.eval()
    _evaluate_by_layer(shard)
    if for_decoding and shard.fast_path.few_row_kernel:
        few_row_matmul.build_kernel_variants(shard)
    return shard


def _evaluate_by_layer(shard: ModelShard) -> None:
    """Read the lazy weights in, one decoder layer at a time, then the rest. A fused array
    is built from its parts (`cluster.model.fused`); evaluated all at once, MLX reads parts of
    many layers before it builds their fused arrays (a load's peak 1.20x the shard's bytes on
    the bundled model); a layer at a time, 1.00x."""
    for _, module in shard.named_modules():
        if isinstance(module, PackedDecoderLayer):
            mx.eval(module.parameters())
    mx.eval(shard.parameters())


def _read_weights(
    index: CheckpointIndex, spec: ShardSpec, wanted: set[str], config: ModelConfig
) -> dict[str, mx.array]:
    names: dict[str, str] = {}  # shard name -> source key
    for key in index.files:
        name = index.shard_name(key)
        if name is None:
            continue
        name = _local_layer_name(name, spec)
        if name is not None and _is_wanted(name, wanted):
            names[name] = key
    by_file: dict[str, list[str]] = {}
    for name, key in names.items():
        by_file.setdefault(index.files[key], []).append(name)
    weights: dict[str, mx.array] = {}
    for file_name, file_names in by_file.items():
        tensors = mx.load(str(index.path / file_name))
        for name in file_names:
            weights[name] = tensors[names[name]]
    if index.raw_hf:
        weights = _from_hf_layout(weights, config.text.num_experts)
    return weights


def _local_layer_name(name: str, spec: ShardSpec) -> str | None:
    match = _LAYER.match(name)
    if match is None:
        return name
    layer = int(match.group(1))
    if not (spec.start <= layer < spec.end):
        return None
    return f"layers.{layer - spec.start}.{match.group(2)}"


def _is_wanted(name: str, wanted: set[str]) -> bool:
    """A source tensor is read when it feeds a parameter of the shard (possibly after the
    expert fusion or quantization renames it)."""
    if name in wanted:
        return True
    module = name.rsplit(".", 1)[0]
    if f"{module}.weight" in wanted:  # quantization's scales/biases beside a weight
        return True
    fused = re.sub(
        r"\.experts\.(\d+\.)?(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$",
        ".switch_mlp.gate_proj.weight",
        name,
    )
    return fused in wanted


def _from_hf_layout(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for name, value in weights.items():
        if name.endswith("conv1d.weight") and value.shape[-1] != 1:
            value = value.moveaxis(2, 1)
        elif _SHIFTED_NORMS.search(name) and value.ndim == 1:
            value = value + 1.0
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".experts.gate_up_proj")
            mid = value.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".experts.down_proj")
            out[f"{prefix}.switch_mlp.down_proj.weight"] = value
        elif match := _EXPERT.match(name):
            prefix, expert, proj = match.groups()
            experts.setdefault((prefix, proj), {})[int(expert)] = value
        else:
            out[name] = value
    for (prefix, proj), per_expert in experts.items():
        missing = sorted(set(range(num_experts)) - set(per_expert))
        if missing:
            raise MissingTensorError(f"{prefix}.experts.{missing[0]}.{proj}.weight is missing")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack(
            [per_expert[e] for e in range(num_experts)]
        )
    return out


def _quantize_like_checkpoint(
    shard: ModelShard, weights: dict[str, mx.array], config: ModelConfig
) -> None:
    """Quantize exactly the modules the checkpoint stores quantized (as mlx-lm's loader)."""
    q = config.quantization or {}
    overrides = {
        name: value
        for path, value in q.items()
        if isinstance(value, dict) and (name := _override_name(path, shard.spec)) is not None
    }

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if f"{path}.scales" not in weights:
            return False
        return overrides.get(path, True)

    nn.quantize(
        shard,
        group_size=q.get("group_size", 64),
        bits=q.get("bits", 4),
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


def _override_name(path: str, spec: ShardSpec) -> str | None:
    """A quantization override's module path in the shard (None: another shard's layer)."""
    return _local_layer_name(path.removeprefix("language_model.").removeprefix("model."), spec)


def _global_name(name: str, spec: ShardSpec) -> str:
    """A shard-local parameter name as the model knows it (layer index over the whole model)."""
    match = _LAYER.match(name)
    return f"layers.{int(match.group(1)) + spec.start}.{match.group(2)}" if match else name


def _check_complete(
    wanted: dict[str, mx.array], weights: dict[str, mx.array], where: Path, spec: ShardSpec
) -> None:
    missing = sorted(set(wanted) - set(weights))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingTensorError(f"{where} lacks tensor {_global_name(missing[0], spec)!r}{more}")
    for name, param in wanted.items():
        if weights[name].shape != param.shape:
            raise ModelDirError(
                f"{where}: tensor {_global_name(name, spec)!r} has shape "
                f"{tuple(weights[name].shape)}, "
                f"expected {tuple(param.shape)}"
            )
    extra = sorted(set(weights) - set(wanted))
    if extra:
        raise ModelDirError(
            f"{where}: unexpected tensor {_global_name(extra[0], spec)!r} for this model"
        )


def _cast(name: str, value: mx.array, dtype: mx.Dtype | None, config: ModelConfig) -> mx.array:
    if not mx.issubdtype(value.dtype, mx.floating) or name.endswith("A_log"):
        return value
    if config.is_moe and ".switch_mlp." in name and mx.default_device() == mx.cpu:
        # MLX's CPU gather_mm (the MoE experts) supports float32 only.
        return value.astype(mx.float32)
    return value if dtype is None else value.astype(dtype)


def has_mtp_head(model_dir: str | Path) -> bool:
    """Whether the model's tail loads an MTP head: the config declares one and the weights
    hold its `mtp.*` tensors (as `load_shard` decides)."""
    config = load_model_config(model_dir)
    return config.mtp_layers > 0 and CheckpointIndex.read(config.path).has_mtp


def shard_tensor_names(model_dir: str | Path, spec: ShardSpec) -> Iterable[str]:
    """The source keys a shard reads (what a node fetches; the tests; the memory benchmark)."""
    config = load_model_config(model_dir)
    index = CheckpointIndex.read(config.path)
    with_mtp = spec.is_tail and config.mtp_layers > 0 and index.has_mtp  # as load_shard
    shard = ModelShard(config, spec, with_mtp=with_mtp)
    wanted = set(dict(tree_flatten(shard.parameters())))
    for key in index.files:
        name = index.shard_name(key)
        name = name and _local_layer_name(name, spec)
        if name is not None and _is_wanted(name, wanted):
            yield key
