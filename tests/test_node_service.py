"""The node's service definitions (launchd agent, systemd --user unit) and the supervised
process: what they run, that they restart it, and that the secret is never in them."""

from __future__ import annotations

import plistlib
import sys
import time
from pathlib import Path

from cluster.hosts.remote import node_argv
from cluster.hosts.service import NodeService
from cluster.secret import write_secret

SECRET = "s3cr3t-" + "0" * 40


def service(tmp_path: Path, kind: str, argv: list[str] | None = None) -> NodeService:
    argv = argv or node_argv("mac-1", 50151, tmp_path / "secret", 64.0)
    return NodeService("mac-1", kind, str(tmp_path), tuple(argv), (("PYTHONPATH", "/opt/q"),))


def test_launchd_agent(tmp_path: Path):
    plist = service(tmp_path, "launchd").launchd_plist()
    plistlib.dumps(plist)  # a valid property list
    assert plist["Label"] == "com.qwencluster.node.mac-1"
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    args = plist["ProgramArguments"]
    assert args[:4] == [sys.executable, "-m", "cluster", "node"]
    assert args[args.index("--token-file") + 1] == str(tmp_path / "secret")
    assert args[args.index("--memory-gb") + 1] == "64"
    assert plist["EnvironmentVariables"] == {"PYTHONPATH": "/opt/q"}
    assert SECRET not in repr(plist) and "--token" not in args


def test_systemd_user_unit(tmp_path: Path):
    unit = service(tmp_path, "systemd").systemd_unit()
    assert "Restart=always" in unit and "WantedBy=default.target" in unit
    assert f"--token-file {tmp_path / 'secret'}" in unit and "Environment=PYTHONPATH=/opt/q" in unit
    assert SECRET not in unit


def test_supervised_process_restarts_its_child_and_stops_for_good(tmp_path: Path):
    """The supervisor restarts a child that dies, and `remove` ends both and the state."""
    write_secret(tmp_path / "secret", SECRET)
    marker = tmp_path / "starts"
    child = [
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(0.3)",
    ]
    node = service(tmp_path / "state", "process", child)
    node.install()
    assert node.running()
    deadline = time.monotonic() + 20
    while not (marker.exists() and len(marker.read_text()) >= 2):  # died once, started again
        assert time.monotonic() < deadline, "the supervisor did not restart its child"
        time.sleep(0.05)
    recorded = NodeService.recorded(tmp_path / "state")
    assert recorded == node
    node.remove()
    assert not node.running() and not (tmp_path / "state").exists()


def test_nodes_sharing_a_host_are_installed_with_their_share(tmp_path: Path, monkeypatch):
    from cluster.hosts import bringup
    from cluster.hosts.clusterfile import HostNode

    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(bringup, "hosts_command", lambda ssh, node, *args, **kw: asked.append(args))
    bringup._install(None, SECRET, HostNode(ssh="studio", name="studio-1", memory_share=0.5))
    bringup._install(None, SECRET, HostNode(ssh="mac-2", name="mac-2"))
    shared, alone = asked
    assert shared[shared.index("--memory-share") + 1] == "0.500000"
    assert "--memory-share" not in alone
    # and the service runs the node with it
    argv = node_argv("studio-1", 50151, tmp_path / "secret", None, 0.5)
    assert argv[argv.index("--memory-share") + 1] == "0.500000"
    assert "--memory-share" not in node_argv("mac-2", 50151, tmp_path / "secret", None)
