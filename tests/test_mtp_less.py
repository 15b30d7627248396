"""Checkpoints without the MTP head (every mlx-community conversion of Qwen3.5 drops `mtp.*`):
they serve with MTP off and say so, `cluster convert --mtp-from` grafts the head back from the
original release, and `--model owner/name` reads a Hugging Face cache, offline."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from cluster.commands.convert import convert_command
from cluster.commands.generate import generate_command
from cluster.config import bundled_model_path
from cluster.model.convert import convert
from cluster.model.loading import NO_MTP_HEAD, has_mtp_head
from tests.daemons import NO_WARMUP, START_DEADLINE_S, free_port, stop_process_group, wait_until
from tests.test_hub import lay_out_hub_cache, python_offline

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 24
_ENDPOINT = re.compile(r"OpenAI endpoint: (\S+)/v1")


def strip_mtp(model: Path) -> Path:
    """Remove the `mtp.*` tensors from an MLX directory, files and index, as mlx-lm does."""
    index_file = model / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for name in set(index["weight_map"].values()):
        tensors = mx.load(str(model / name))
        kept = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        mx.save_safetensors(str(model / name), kept, metadata={"format": "mlx"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    index_file.write_text(json.dumps(index, indent=4))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 and 4-bit conversions of the bundled model, each also without its MTP head."""
    root = tmp_path_factory.mktemp("mtp-less")
    out = {}
    for name, bits in (("bf16", None), ("q4", 4)):
        out[name] = convert(bundled_model_path(), root / name, q_bits=bits)
        stripped = convert(bundled_model_path(), root / f"{name}-no-mtp", q_bits=bits)
        out[f"{name}-no-mtp"] = strip_mtp(stripped)
    return out


def generate(model: Path | str, *flags: str) -> tuple[dict, str]:
    result = CliRunner().invoke(
        generate_command,
        [
            "--model",
            str(model),
            "--prompt",
            PROMPT,
            "--json",
            "--max-tokens",
            str(MAX_TOKENS),
            *flags,
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_generate_serves_a_checkpoint_without_mtp_and_says_so(checkpoints: dict[str, Path]):
    model = checkpoints["bf16-no-mtp"]
    assert not has_mtp_head(model) and has_mtp_head(checkpoints["bf16"])
    out, err = generate(model, "--mtp-depth", "3")
    assert NO_MTP_HEAD in err
    assert out["drafted"] == 0 and out["accepted"] == 0
    reference, _ = generate(checkpoints["bf16"], "--no-mtp")
    assert out["tokens"] == reference["tokens"]


@pytest.mark.parametrize("name", ["bf16", "q4"])
def test_mtp_from_grafts_the_original_head_back(
    checkpoints: dict[str, Path], tmp_path: Path, name: str
):
    grafted = tmp_path / "grafted"
    result = CliRunner().invoke(
        convert_command,
        [str(checkpoints[f"{name}-no-mtp"]), str(grafted), "--mtp-from", str(bundled_model_path())],
    )
    assert result.exit_code == 0, result.output
    # Quantized as `cluster convert` quantizes: the very tensors and config of a conversion.
    original = checkpoints[name]
    config = json.loads((grafted / "config.json").read_text())
    assert config == json.loads((original / "config.json").read_text())
    want = {k: v for f in original.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    got = {k: v for f in grafted.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    assert got.keys() == want.keys()
    assert all(mx.array_equal(got[k], want[k]).item() for k in want if k.startswith("mtp."))

    # At a fixed depth: `auto`'s choices follow the machine's timings, a fixed depth drafts
    # alike on both, so their verdicts compare.
    on, _ = generate(grafted, "--mtp-depth", "1")
    off, _ = generate(grafted, "--no-mtp")
    reference, _ = generate(original, "--mtp-depth", "1")
    assert on["tokens"] == off["tokens"] == reference["tokens"]
    assert on["accepted"] > 0
    assert (on["drafted"], on["accepted"]) == (reference["drafted"], reference["accepted"])


def test_mtp_from_refuses_what_has_no_head(checkpoints: dict[str, Path], tmp_path: Path):
    result = CliRunner().invoke(
        convert_command,
        [
            str(checkpoints["bf16-no-mtp"]),
            str(tmp_path / "x"),
            "--mtp-from",
            str(checkpoints["q4-no-mtp"]),
        ],
    )
    assert result.exit_code != 0 and "no mtp.* tensors to graft" in result.output


def test_generate_takes_a_repo_id_from_an_offline_hub_cache(tmp_path: Path):
    lay_out_hub_cache(tmp_path / "hf", "someone/tiny", bundled_model_path())
    done = python_offline(
        tmp_path / "hf", "-m", "cluster", "generate", "--model", "someone/tiny",
        "--prompt", PROMPT, "--max-tokens", "8", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 8


def test_mtp_from_a_repo_id_in_an_offline_hub_cache(checkpoints: dict[str, Path], tmp_path: Path):
    lay_out_hub_cache(tmp_path / "hf", "Qwen/tiny", bundled_model_path())
    done = python_offline(
        tmp_path / "hf", "-m", "cluster", "convert", str(checkpoints["bf16-no-mtp"]),
        str(tmp_path / "grafted"), "--mtp-from", "Qwen/tiny",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert has_mtp_head(tmp_path / "grafted")


def test_the_coordinator_serves_without_drafts_and_says_so(
    checkpoints: dict[str, Path], tmp_path: Path
):
    log = tmp_path / "up.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster",
            "up",
            "--local",
            "2",
            "--port",
            str(free_port()),
            "--model",
            str(checkpoints["bf16-no-mtp"]),
            "--mtp-depth",
            "2",
            NO_WARMUP,
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def endpoint() -> str | None:
            assert process.poll() is None, log.read_text()
            found = _ENDPOINT.search(log.read_text())
            return found.group(1) if found else None

        url = wait_until(endpoint, "cluster up's endpoint", START_DEADLINE_S)
        head = log.read_text().split("OpenAI endpoint")[0]
        assert NO_MTP_HEAD in head  # said before serving, among the first lines

        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "mtp": True, "mtp_depth": 3}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            usage = json.load(response)["usage"]
        assert usage["completion_tokens"] == 16
        details = usage.get("completion_tokens_details", {})  # present only with drafts
        assert details.get("accepted_prediction_tokens", 0) == 0
        assert details.get("rejected_prediction_tokens", 0) == 0

        with urllib.request.urlopen(f"{url}/api/cluster", timeout=10) as response:
            document = json.load(response)
        assert document["model"]["mtp_head"] is False
        assert document["model"]["note"] == NO_MTP_HEAD
        assert document["stats"]["acceptance_rate"] == 0

        status = [sys.executable, "-m", "cluster", "status", "--url", url]
        text = subprocess.run(status, capture_output=True, text=True, timeout=30, check=True)
        assert NO_MTP_HEAD in text.stdout.splitlines()[1]
        as_json = subprocess.run(
            [*status, "--json"], capture_output=True, text=True, timeout=30, check=True
        )
        assert json.loads(as_json.stdout)["model"]["note"] == NO_MTP_HEAD
    finally:
        stop_process_group(process, timeout_s=30)


def test_a_request_asking_for_mtp_of_a_headless_model_shows_0_drafted():
    """Served by a model without an MTP head, a request that asks for MTP (explicitly, or by
    the default) gets usage with 0 accepted and 0 rejected drafts, streamed or whole; one
    that turns MTP off (or asks for depth 0) gets no draft counts at all."""
    from coordinator.admission import AdmissionController
    from coordinator.api import ServedModel, create_app
    from tests.fakes import MODEL_ID, FakeClusterView, FakeEngine, ServedApp, tokenizer

    engine = FakeEngine(reply=lambda _request: (5, 6, 7, 8), chunk_size=16)  # one chunk
    view = FakeClusterView()
    admission = AdmissionController(4, 8, 10.0)
    app = create_app(
        engine, tokenizer(), view, served=ServedModel(MODEL_ID, mtp_head=False), admission=admission
    )
    served = ServedApp(app)
    served.start()

    def usage(**extra: object) -> dict:
        body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True, **extra}
        request = urllib.request.Request(
            f"{served.url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            if not extra.get("stream"):
                return json.load(response)["usage"]
            events = [line[6:] for line in response.read().decode().splitlines()]
            (last,) = [json.loads(e) for e in events if e.startswith("{") and '"usage"' in e]
            return last["usage"]

    zero = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    try:
        assert usage(mtp=True, mtp_depth=3)["completion_tokens_details"] == zero
        assert usage()["completion_tokens_details"] == zero  # MTP is on by default
        streamed = usage(stream=True, stream_options={"include_usage": True})
        assert streamed["completion_tokens_details"] == zero
        assert "completion_tokens_details" not in usage(mtp=False)
        assert "completion_tokens_details" not in usage(mtp_depth=0)
        assert all(not request.options.mtp for request in engine.requests)  # none drafted
    finally:
        served.stop()
