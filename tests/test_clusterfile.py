"""The cluster file's parsing (every mistake named with its key) and the secret file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.hosts.clusterfile import ClusterFileError, default_name, load_cluster_file
from cluster.hosts.ssh import SSH
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


def nodes_of(tmp_path: Path, *tables: str) -> list[tuple[str, str]]:
    text = f'model = "{MODEL}"\n' + "".join(f"[[node]]\n{t}\n" for t in tables)
    return [(n.ssh, n.name) for n in parse(tmp_path, text).nodes]


def test_ip_address_targets_are_named_by_their_whole_address(tmp_path: Path):
    targets = ["root@10.78.0.1", "root@10.78.0.2", "10.78.0.3"]
    names = nodes_of(tmp_path, *(f'ssh = "{t}"' for t in targets))
    assert names == [(t, t.removeprefix("root@")) for t in targets]


@pytest.mark.parametrize(
    ("ssh", "name"),
    [
        ("me@mac-1.local", "mac-1"),
        ("mac-studio-1", "mac-studio-1"),  # an ssh alias, as it is
        ("10.0.0.2", "10.0.0.2"),
        ("user@10.0.0.2", "10.0.0.2"),
        ("[fe80::1]", "fe80--1"),
        ("root@[2001:db8::7]", "2001-db8--7"),
        ("fe80::1%en0", "fe80--1-en0"),
        ("ssh://me@mac-2.local:2222", "mac-2"),
        ("::1", "host--1"),
    ],
)
def test_a_name_from_every_kind_of_ssh_target(ssh: str, name: str):
    assert default_name(ssh) == name


@pytest.mark.parametrize("ssh", ["[fe80::1]", "me@[2001:db8::7]:22", "a:b@c.d", "x y", "::1"])
def test_default_names_are_safe_as_labels_units_and_directories(ssh: str):
    """The name becomes `com.qwencluster.node.NAME` (launchd), `qwencluster-node-NAME`
    (systemd), a state directory and the node id: no ':', '/', '%' or spaces in it."""
    import re

    name = default_name(ssh, 50160)
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", name), name
    assert name.endswith("-50160")


@pytest.mark.parametrize(
    ("target", "argv"),
    [
        ("root@[fe80::1]", ["--", "root@fe80::1"]),  # ssh resolves no brackets
        ("[2001:db8::7]:2222", ["-p", "2222", "--", "2001:db8::7"]),
        ("root@10.0.0.2", ["--", "root@10.0.0.2"]),
        ("mac-1", ["--", "mac-1"]),
    ],
)
def test_ssh_reaches_every_target_as_written(target: str, argv: list[str]):
    assert SSH().argv(target, ["true"])[-len(argv) - 1 : -1] == argv


def test_nodes_of_one_host_on_two_ports_get_two_names(tmp_path: Path):
    names = nodes_of(
        tmp_path, 'ssh = "root@10.0.0.2"', 'ssh = "root@10.0.0.2"\nport = 50152',
        'ssh = "mac-1.local"\nport = 50153', 'ssh = "mac-1.local"\nport = 50154',
    )  # fmt: skip
    assert [n for _, n in names] == ["10.0.0.2", "10.0.0.2-50152", "mac-1", "mac-1-50154"]
    # The lowest port keeps the plain name, wherever it is in the file: adding a node on a
    # higher port renames none of those already installed.
    names = nodes_of(tmp_path, 'ssh = "10.0.0.2"\nport = 50300', 'ssh = "10.0.0.2"\nport = 50200')
    assert [n for _, n in names] == ["10.0.0.2-50300", "10.0.0.2"]


def test_hosts_alike_in_their_first_label_keep_their_domain(tmp_path: Path):
    """Only the names that would clash change: a node added later does not rename the others
    unless it clashes with them."""
    names = nodes_of(
        tmp_path, 'ssh = "mac-1.lan"', 'ssh = "mac-1.office"', 'ssh = "mac-2.lan"',
        'ssh = "mac-1.lan"\nport = 50152',
    )  # fmt: skip
    assert [n for _, n in names] == ["mac-1.lan", "mac-1.office", "mac-2", "mac-1.lan-50152"]


def test_a_given_name_wins(tmp_path: Path):
    names = nodes_of(tmp_path, 'ssh = "root@10.0.0.2"\nname = "studio"', 'ssh = "10.0.0.3"')
    assert [n for _, n in names] == ["studio", "10.0.0.3"]


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
        (
            'model = "{model}"\n[[node]]\nssh = "a"\nname = "b"\n[[node]]\nssh = "b"\n',
            "share the name",
        ),
        ('model = "{model}"\n[[node]]\nssh = "a"\n[[node]]\nssh = "me@a"\n', "one host and port"),
        ('model = "{model}"\n[[node]]\nssh = "a"\nname = "a/b"\n', "use letters, digits"),
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


def test_nodes_on_one_host_share_its_memory(tmp_path: Path):
    text = (
        f'model = "{MODEL}"\n'
        '[[node]]\nssh = "me@studio"\nport = 50151\n'
        '[[node]]\nssh = "studio"\nport = 50152\n'
        '[[node]]\nssh = "mac-2"\n'
    )
    shares = {(n.ssh, n.port): n.memory_share for n in parse(tmp_path, text).nodes}
    assert shares == {("me@studio", 50151): 0.5, ("studio", 50152): 0.5, ("mac-2", 50151): 1.0}
