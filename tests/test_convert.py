"""cluster.model.convert: Hugging Face (or MLX) checkpoints to MLX directories that keep `mtp.*`.

Quantized models run with float32 activations here (`load_shard(dtype=mx.float32)`): MLX's CPU
quantized matmul is several times slower in bf16, and the tests measure quantization error,
which the activation dtype barely changes.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from checkpoints import make_checkpoint
from click.testing import CliRunner
from conftest import CODE_PROMPTS, run
from mlx.utils import tree_flatten
from test_loading import forward, params, raw_tensors, spec

import cluster.model.convert as convert_module
from cluster.commands.convert import convert_command
from cluster.config import ModelDirError, load_model_config
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.pipeline import LocalPipeline
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.model.convert import ConvertError, convert
from cluster.model.loading import load_shard
from cluster.model.shard import ModelShard, ShardSpec

BITS = {"bf16": None, "q8": 8, "q4": 4}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    return {name: convert(model_dir, root / name, q_bits=bits) for name, bits in BITS.items()}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        layout: make_checkpoint(root / layout, moe=True, mtp_experts=layout)
        for layout in ("per_expert", "fused")
    }


def load(path: Path, shard_spec: ShardSpec | None = None) -> ModelShard:
    quantized = load_model_config(path).quantization is not None
    return load_shard(path, shard_spec, dtype=mx.float32 if quantized else None)


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def index_keys(path: Path) -> set[str]:
    return set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


# -- layout and contents ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BITS))
def test_keeps_mtp_weights_in_mlx_layout(converted: dict[str, Path], model_dir: Path, name: str):
    out = converted[name]
    keys = index_keys(out)
    assert keys == set(raw_tensors(out))
    assert all(
        k.startswith(("language_model.model.", "language_model.lm_head.", "mtp.")) for k in keys
    )
    raw_mtp = {k for k in raw_tensors(model_dir) if k.startswith("mtp.")}
    assert raw_mtp <= keys
    quantized = {k.removesuffix(".scales") for k in keys if k.endswith(".scales")}
    config = read_config(out)
    if BITS[name] is None:
        assert not quantized and {k for k in keys if k.startswith("mtp.")} == raw_mtp
        assert "quantization" not in config
    else:
        assert "mtp.layers.0.self_attn.q_proj" in quantized
        assert "language_model.model.embed_tokens" in quantized
        assert "mtp.fc" not in quantized  # kept in full precision
        assert not any(k.endswith(("norm", "conv1d")) for k in quantized)
        expected = {"group_size": 64, "bits": BITS[name], "mode": "affine"}
        assert config["quantization"] == config["quantization_config"] == expected
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / file).read_bytes() == (model_dir / file).read_bytes()
    # Norms are stored shifted in the MLX layout (so a loader never shifts them again).
    raw, got = raw_tensors(model_dir), raw_tensors(out)
    for source, target in (
        ("mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden.weight"),
        ("model.language_model.norm.weight", "language_model.model.norm.weight"),
    ):
        assert mx.array_equal(got[target], raw[source] + 1)


def test_bf16_conversion_equals_the_raw_model(converted: dict[str, Path], model_dir: Path):
    raw_shard, ours = load_shard(model_dir), load_shard(converted["bf16"])
    expected, got = params(raw_shard), params(ours)
    assert expected.keys() == got.keys()
    assert all(mx.array_equal(expected[k], got[k]) for k in expected)
    logits = forward([raw_shard])
    assert mx.array_equal(forward([ours]), logits)
    shards = [
        load_shard(converted["bf16"], spec(0, 3, 8)),
        load_shard(converted["bf16"], spec(3, 8, 8)),
    ]
    assert mx.array_equal(forward(shards), logits)


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_quantized_loads_whole_and_as_shards(converted: dict[str, Path], name: str):
    whole = load(converted[name])
    head, tail = load(converted[name], spec(0, 3, 8)), load(converted[name], spec(3, 8, 8))
    assert whole.has_mtp and tail.has_mtp
    assert not isinstance(whole.mtp.fc, nn.QuantizedLinear)
    assert isinstance(whole.mtp.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert mx.allclose(forward([head, tail]), forward([whole]), atol=1e-4).item()


def test_quantized_models_agree_with_the_unquantized_one(converted: dict[str, Path], tokenizer):
    """Teacher-forced top-1 agreement with the unquantized model on real code (the stdlib
    the bundled model was trained on), so that one early divergence does not compound."""
    tokens = tokenizer.encode(inspect.getsource(textwrap)[:1500])[:96]
    reference = forward([load_shard(converted["bf16"], dtype=mx.float32)], tokens).argmax(-1)
    agreement = {}
    for name in ("q8", "q4"):
        top1 = forward([load(converted[name])], tokens).argmax(-1)
        agreement[name] = (top1 == reference).mean().item()
    print(f"\ntop-1 agreement with bf16 over {len(tokens)} positions: {agreement}")
    assert agreement["q8"] >= 0.93 and agreement["q4"] >= 0.75


async def _generate(path: Path, shard: ModelShard, prompts: list[list[int]], max_tokens: int):
    worker = MLXWorker()
    try:
        max_context = load_model_config(path).max_context
        engine = GenerationEngine(
            LocalPipeline([ShardRunner(shard)], worker, max_context=max_context)
        )
        return [await engine.generate(GenerationRequest(tuple(p), max_tokens)) for p in prompts]
    finally:
        worker.close()


@pytest.mark.parametrize("name", list(BITS))
def test_converted_model_generates_with_mtp(converted: dict[str, Path], tokenizer, name: str):
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS[:2]]
    outputs = run(_generate(converted[name], load(converted[name]), prompts, 24))
    drafted = sum(o.drafted for o in outputs)
    accepted = sum(o.accepted for o in outputs)
    print(f"\n{name}: MTP acceptance {accepted}/{drafted} = {accepted / drafted:.2f}")
    assert all(len(o.tokens) == 24 for o in outputs)
    assert drafted > 0 and accepted / drafted > 0.5


# -- the MoE fixture -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_moe_fixture_converts_and_loads(
    moe_checkpoints: dict[str, Path], tmp_path: Path, layout: str
):
    src = moe_checkpoints[layout]
    raw_shard = load_shard(src)
    bf16 = convert(src, tmp_path / "bf16")
    assert {k for k in index_keys(bf16) if k.startswith("mtp.layers.0.mlp.switch_mlp.")} == {
        f"mtp.layers.0.mlp.switch_mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    }
    ours = load_shard(bf16)
    expected, got = params(raw_shard), params(ours)
    assert expected.keys() == got.keys()
    assert all(mx.array_equal(expected[k], got[k]) for k in expected)
    assert mx.array_equal(forward([ours]), forward([raw_shard]))

    q4 = convert(src, tmp_path / "q4", q_bits=4)
    config = read_config(q4)["quantization"]
    router = {"group_size": 64, "bits": 8}
    for path in ("language_model.model.layers.3.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate"):
        assert config[path] == router
    assert "mtp.layers.0.mlp.switch_mlp.down_proj.scales" in index_keys(q4)
    whole = load(q4)
    shards = [load(q4, spec(0, 2, 4)), load(q4, spec(2, 4, 4))]
    assert whole.has_mtp and shards[1].has_mtp
    assert mx.allclose(forward(shards), forward([whole]), atol=1e-4).item()


def test_moe_layouts_convert_to_the_same_files(moe_checkpoints: dict[str, Path], tmp_path: Path):
    a = raw_tensors(convert(moe_checkpoints["per_expert"], tmp_path / "a", q_bits=8))
    b = raw_tensors(convert(moe_checkpoints["fused"], tmp_path / "b", q_bits=8))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]) for k in a)


def test_quantizes_like_mlx_lm(moe_checkpoints: dict[str, Path], tmp_path: Path):
    """The backbone tensors and the quantization map are exactly mlx-lm's own (and mlx-lm
    loads the directory, ignoring `mtp.*`)."""
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import load_config, quantize_model

    src = moe_checkpoints["fused"]
    ours = convert(src, tmp_path / "ours", q_bits=4)
    model, _ = mlx_lm_load(str(src), lazy=True)
    model, config = quantize_model(model, load_config(src), 64, 4)
    expected = dict(tree_flatten(model.parameters()))
    got = raw_tensors(ours)
    assert expected.keys() == {k for k in got if not k.startswith("mtp.")}
    assert all(mx.array_equal(expected[k], got[k]) for k in expected)
    quantization = read_config(ours)["quantization"]
    assert {k: v for k, v in quantization.items() if not k.startswith("mtp.")} == config[
        "quantization"
    ]
    mlx_lm_load(str(ours))


# -- re-conversion, dtype, shards, options ---------------------------------------------------


@pytest.mark.parametrize("name", ["bf16", "q8"])
def test_converting_a_converted_dir_changes_nothing(
    converted: dict[str, Path], tmp_path: Path, name: str
):
    again = convert(converted[name], tmp_path / "again")
    a, b = raw_tensors(converted[name]), raw_tensors(again)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    assert read_config(again) == read_config(converted[name])
    if name == "q8":
        with pytest.raises(ConvertError, match="already quantized"):
            convert(converted[name], tmp_path / "requantized", q_bits=4)


def test_dtype_casts_all_but_a_log(moe_checkpoints: dict[str, Path], tmp_path: Path):
    out = convert(moe_checkpoints["fused"], tmp_path / "f16", dtype="float16")
    for key, value in raw_tensors(out).items():
        assert value.dtype == (mx.bfloat16 if key.endswith("A_log") else mx.float16), key
    config = read_config(out)
    assert config["dtype"] == config["text_config"]["dtype"] == "float16"
    assert load_shard(out).has_mtp


def test_splits_files_at_the_size_limit(
    converted: dict[str, Path], model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    limit = 3 << 20
    monkeypatch.setattr(convert_module, "MAX_FILE_BYTES", limit)
    out = convert(model_dir, tmp_path / "split")
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 4 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    for file in files:
        tensors = mx.load(str(file))
        assert len(tensors) == 1 or sum(v.nbytes for v in tensors.values()) <= limit
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in raw_tensors(out).values())
    a, b = params(load_shard(out)), params(load_shard(converted["bf16"]))
    assert all(mx.array_equal(a[k], b[k]) for k in a)


def test_quantize_mtp_fc_option(model_dir: Path, tmp_path: Path):
    out = convert(model_dir, tmp_path / "fc", q_bits=8, quantize_mtp_fc=True)
    assert "mtp.fc.scales" in index_keys(out)
    assert isinstance(load(out).mtp.fc, nn.QuantizedLinear)


def test_tied_fixture_converts(tmp_path: Path):
    src = make_checkpoint(tmp_path / "hf", moe=False, tie_word_embeddings=True)
    out = convert(src, tmp_path / "mlx", q_bits=8)
    assert not any("lm_head" in k for k in index_keys(out))
    assert mx.all(mx.isfinite(forward([load(out)]))).item()


# -- errors and the command ------------------------------------------------------------------


def test_errors(model_dir: Path, tmp_path: Path):
    with pytest.raises(ModelDirError, match=r"config\.json"):
        convert(tmp_path / "nothing", tmp_path / "out")
    src = make_checkpoint(tmp_path / "llama", moe=False)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ModelDirError, match="'llama'"):
        convert(src, tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError, match="not empty"):
        convert(model_dir, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").exists()
    with pytest.raises(ConvertError, match="q_bits"):
        convert(model_dir, tmp_path / "out", q_bits=3)
    ok = make_checkpoint(tmp_path / "ok", moe=False)
    for dst in (ok, tmp_path):
        with pytest.raises(ConvertError, match="overwrite the source"):
            convert(ok, dst, force=True)
    assert load_shard(ok).has_mtp
    foreign = make_checkpoint(tmp_path / "fp8", moe=False)
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(
        json.dumps(config | {"quantization_config": {"quant_method": "fp8"}})
    )
    with pytest.raises(ConvertError, match="fp8"):
        convert(foreign, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_force_replaces_and_a_failure_leaves_nothing(model_dir: Path, tmp_path: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.safetensors").write_text("old")
    out = convert(model_dir, tmp_path / "out", force=True)
    assert not (out / "stale.safetensors").exists() and load_shard(out).has_mtp
    broken = make_checkpoint(tmp_path / "broken", moe=False)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.language_model.layers.3.self_attn.o_proj.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelDirError, match="o_proj"):
        convert(broken, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"]


def test_command(model_dir: Path, tmp_path: Path):
    runner = CliRunner()
    result = runner.invoke(convert_command, [str(model_dir), str(tmp_path / "q"), "--q-bits", "8"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and load(tmp_path / "q").has_mtp
    result = runner.invoke(convert_command, [str(model_dir), str(tmp_path / "q")])
    assert result.exit_code == 1 and "--force" in result.output
    result = runner.invoke(convert_command, [str(tmp_path / "none"), str(tmp_path / "x")])
    assert result.exit_code == 1 and "config.json" in result.output
    result = runner.invoke(convert_command, [str(model_dir), str(tmp_path / "x"), "--q-bits", "5"])
    assert result.exit_code == 2
