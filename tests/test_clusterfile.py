"""The cluster file's parsing (every mistake named with its key) and the secret file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.hosts.clusterfile import ClusterFileError, load_cluster_file
from cluster.secret import SecretFileError, ensure_secret, read_secret

MODEL = Path(__file__).resolve().parent.parent / "cluster" / "assets" / "qwen3_5-tiny-mtp"


def parse(tmp_path: Path, text: str):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return load_cluster_file(path)


def test_a_full_file(tmp_path: Path):
    cluster = parse(
        tmp_path,
        f'model = "{MODEL}"\nport = 8123\n'
        '[[node]]\nssh = "me@mac-1.local"\naddress = "10.10.0.1"\nport = 50200\n'
        'memory_gb = 64\ncluster = "/opt/q/bin/cluster"\n'
        '[[node]]\nssh = "mac-2"\n',
    )
    assert cluster.port == 8123 and cluster.model == MODEL
    first, second = cluster.nodes
    assert (first.name, first.address, first.port, first.memory_gb) == (
        "mac-1", "10.10.0.1", 50200, 64.0
    )  # fmt: skip
    assert first.cluster == "/opt/q/bin/cluster"
    assert (second.name, second.address, second.port, second.cluster) == (
        "mac-2", None, 50151, "cluster"
    )  # fmt: skip
    assert cluster.secret_path == tmp_path / ".cluster.secret"


def test_the_example_in_deploy_parses(tmp_path: Path):
    example = Path(__file__).resolve().parent.parent / "deploy" / "cluster.example.toml"
    text = example.read_text().replace("/Users/me/models/Qwen3.5-122B-A10B-4bit", str(MODEL))
    assert [n.ssh for n in parse(tmp_path, text).nodes] == ["mac-1", "mac-2", "mac-3"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[node]]\nssh = "a"\n', "needs model ="),
        ('model = "{model}"\n', "at least one [[node]]"),
        ('model = "{model}"\n[[node]]\naddress = "x"\n', "#1: needs ssh ="),
        ('model = "{model}"\n[[node]]\nssh = "a"\nadress = "x"\n', "did you mean 'address'"),
        ('model = "{model}"\nprot = 1\n[[node]]\nssh = "a"\n', "did you mean 'port'"),
        ('model = "{model}"\n[[node]]\nssh = "a"\nport = "50151"\n', "port must be a int"),
        ('model = "{model}"\n[[node]]\nssh = "a"\nport = 70000\n', "port must be 1-65535"),
        ('model = "{model}"\n[[node]]\nssh = "a"\nmemory_gb = -1\n', "memory_gb must be pos"),
        ('model = "{model}"\n[[node]]\nssh = "a"\nservice = "cron"\n', "service must be one of"),
        ('model = "{model}"\n[[node]]\nssh = "a.x"\n[[node]]\nssh = "a.y"\n', "share the name"),
        ('model = "/nonexistent"\n[[node]]\nssh = "a"\n', "is not a model directory"),
        ('model = "{model}"\n[[node]\nssh = "a"\n', "not valid TOML"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, text: str, message: str):
    with pytest.raises(ClusterFileError) as caught:
        parse(tmp_path, text.replace("{model}", str(MODEL)))
    assert message in str(caught.value) and str(tmp_path / "cluster.toml") in str(caught.value)


def test_the_secret_is_made_once_and_only_its_owner_reads_it(tmp_path: Path):
    path = tmp_path / "sub" / "secret"
    old_umask = os.umask(0)  # even a permissive umask must not widen the mode
    try:
        secret = ensure_secret(path)
    finally:
        os.umask(old_umask)
    assert path.stat().st_mode & 0o777 == 0o600 and len(secret) == 48
    assert ensure_secret(path) == secret
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match="chmod 600"):
        read_secret(path)
