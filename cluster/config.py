"""A model directory's configuration: which Qwen3.5 it is, its MTP head, its quantization."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.models.qwen3_5 import TextModelArgs

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


class ModelDirError(ValueError):
    """A model directory that cannot be served as it is (names the file or tensor)."""


def bundled_model_path() -> Path:
    """The tiny trained Qwen3.5 shipped with the package: the default model and test fixture."""
    return Path(__file__).parent / "assets" / "qwen3_5-tiny-mtp"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: Path
    model_type: str
    text: TextModelArgs
    mtp_layers: int  # as declared by the config; the weights may still lack them
    quantization: dict[str, Any] | None
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return self.text.num_hidden_layers

    @property
    def is_moe(self) -> bool:
        return self.text.num_experts > 0

    def is_linear(self, layer: int) -> bool:
        return (layer + 1) % self.text.full_attention_interval != 0

    @property
    def max_context(self) -> int:
        return self.text.max_position_embeddings


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirError(f"{path} is not a model directory: it has no config.json")
    raw = json.loads(config_file.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelDirError(
            f"unsupported model_type {model_type!r} in {config_file}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    text_dict = dict(raw.get("text_config", raw))
    text = TextModelArgs.from_dict(text_dict)
    _check_layer_types(text, text_dict.get("layer_types"), config_file)
    return ModelConfig(
        path=path,
        model_type=model_type,
        text=text,
        mtp_layers=int(text_dict.get("mtp_num_hidden_layers", 0) or 0),
        quantization=raw.get("quantization"),
        eos_token_ids=_eos_ids(path, raw, text_dict),
        raw=raw,
    )


def _check_layer_types(text: TextModelArgs, layer_types: list[str] | None, where: Path) -> None:
    """mlx-lm places attention every `full_attention_interval` layers; refuse other patterns."""
    if layer_types is None:
        return
    interval = text.full_attention_interval
    expected = [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(text.num_hidden_layers)
    ]
    if list(layer_types) != expected:
        raise ModelDirError(
            f"{where}: layer_types do not follow full_attention_interval={interval}"
        )


def _eos_ids(path: Path, raw: dict, text: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [raw.get("eos_token_id"), text.get("eos_token_id")]
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
