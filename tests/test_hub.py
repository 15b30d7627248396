"""`--model org/name`: a repo id resolves to its snapshot in the Hugging Face cache, offline, and
a directory is taken as it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import ModelDirError, bundled_model_path
from cluster.hub import looks_like_repo_id, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(hf_home: Path, repo_id: str, source: Path, revision: str = "main") -> Path:
    """The cache layout huggingface_hub writes: refs/REVISION naming a snapshot of the files."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / revision).write_text(COMMIT)
    return snapshot


def python_offline(hf_home: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python ARGV...` in a fresh interpreter with `hf_home` as its offline hub cache:
    huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, at import."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120
    )


def resolve_offline(hf_home: Path, model: str) -> subprocess.CompletedProcess:
    code = "import sys; from cluster.hub import resolve_model; print(resolve_model(sys.argv[1]))"
    return python_offline(hf_home, "-c", code, model)


def test_a_repo_id_resolves_from_an_offline_hub_cache(tmp_path: Path) -> None:
    snapshot = lay_out_hub_cache(tmp_path / "hf", "someone/tiny-qwen", bundled_model_path())
    done = resolve_offline(tmp_path / "hf", "someone/tiny-qwen")
    assert done.returncode == 0, done.stderr
    resolved = Path(done.stdout.strip())
    assert resolved == snapshot
    assert json.loads((resolved / "config.json").read_text())["model_type"]


def test_a_pinned_revision_reads_that_ref(tmp_path: Path) -> None:
    lay_out_hub_cache(tmp_path / "hf", "someone/tiny-qwen", bundled_model_path(), "v1")
    assert resolve_offline(tmp_path / "hf", "someone/tiny-qwen@v1").returncode == 0
    missing = resolve_offline(tmp_path / "hf", "someone/tiny-qwen@v2")
    assert missing.returncode != 0
    assert "not in the Hugging Face cache" in missing.stderr


def test_a_repo_missing_offline_is_a_clear_error(tmp_path: Path) -> None:
    done = resolve_offline(tmp_path / "hf", "someone/absent")
    assert done.returncode != 0
    assert "someone/absent is not in the Hugging Face cache" in done.stderr


def test_a_directory_wins_and_a_missing_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model(bundled_model_path()) == bundled_model_path()
    local = tmp_path / "org" / "name"
    shutil.copytree(bundled_model_path(), local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name") == Path("org/name")  # the directory, not the hub
    with pytest.raises(ModelDirError, match="not a model directory"):
        resolve_model(tmp_path / "nowhere")
    with pytest.raises(ModelDirError, match="not a model directory"):
        resolve_model("./nowhere")


@pytest.mark.parametrize(
    ("text", "is_repo"),
    [
        ("Qwen/Qwen3.5-27B", True),
        ("mlx-community/Qwen3.5-27B-4bit@main", True),
        ("./models/foo", False),
        ("/abs/path", False),
        ("~/models/x", False),
        ("justaname", False),
        ("a/b/c", False),
    ],
)
def test_what_reads_as_a_repo_id(text: str, is_repo: bool) -> None:
    assert looks_like_repo_id(text) is is_repo
