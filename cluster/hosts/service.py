"""The node as a service on its host: installed, found, and removed again.

Three kinds, picked by what the host has: a launchd agent on macOS (`launchctl bootstrap
gui/$UID`, so it starts at login and after a reboot), a `systemd --user` unit elsewhere (with
lingering, so it runs without a login), or else a supervised background process
(`cluster.hosts.supervisor`, in its own session: it survives logout, not a reboot). Everything
a service needs lives in its state directory; `remove` deletes the definition and that
directory, and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import plistlib
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.hosts.supervisor import PID_FILE

LABEL_PREFIX = "com.qwencluster.node."
UNIT_PREFIX = "qwencluster-node-"
STOP_DEADLINE_S = 10.0


class ServiceError(RuntimeError):
    pass


def default_state_dir(name: str) -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "qwencluster" / name
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qwencluster" / name


def _systemd_user_available() -> bool:
    if shutil.which("systemctl") is None:
        return False
    done = subprocess.run(
        ["systemctl", "--user", "is-system-running"], capture_output=True, text=True
    )
    return done.stdout.strip() in {"running", "degraded", "starting"}


def resolve_kind(kind: str) -> str:
    """`auto` -> what this host has; an explicit kind is checked."""
    if kind == "auto":
        if sys.platform == "darwin":
            return "launchd"
        return "systemd" if _systemd_user_available() else "process"
    if kind == "launchd" and sys.platform != "darwin":
        raise ServiceError("service = 'launchd' needs macOS")
    if kind == "systemd" and not _systemd_user_available():
        raise ServiceError("service = 'systemd' needs a running `systemd --user` manager")
    return kind


@dataclass(frozen=True, slots=True)
class NodeService:
    """One node's service definition: what runs and how it is managed."""

    name: str
    kind: str  # launchd, systemd or process
    state_dir: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def record(self) -> Path:
        return Path(self.state_dir) / "service.json"

    @property
    def label(self) -> str:
        return LABEL_PREFIX + self.name

    @property
    def definition(self) -> Path | None:
        """The file a service manager reads (none for a supervised process)."""
        if self.kind == "launchd":
            return Path.home() / "Library" / "LaunchAgents" / f"{self.label}.plist"
        if self.kind == "systemd":
            return (
                Path.home() / ".config" / "systemd" / "user" / f"{UNIT_PREFIX}{self.name}.service"
            )
        return None

    @classmethod
    def recorded(cls, state_dir: Path) -> NodeService | None:
        """The service installed with this state directory, if any."""
        try:
            data = json.loads((state_dir / "service.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(
            data["name"],
            data["kind"],
            data["state_dir"],
            tuple(data["argv"]),
            tuple(tuple(pair) for pair in data["env"]),
        )

    # -- lifecycle --------------------------------------------------------------------------

    def install(self) -> None:
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        self.record.write_text(json.dumps(asdict(self)))
        getattr(self, f"_install_{self.kind}")()

    def remove(self) -> None:
        getattr(self, f"_remove_{self.kind}")()
        if self.definition is not None:
            self.definition.unlink(missing_ok=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def running(self) -> bool:
        return getattr(self, f"_running_{self.kind}")()

    # -- launchd ----------------------------------------------------------------------------

    def _launchd_target(self) -> str:
        return f"gui/{os.getuid()}"

    def launchd_plist(self) -> dict:
        """The launchd agent: started at login (and so after a reboot), restarted if it dies."""
        log = str(Path(self.state_dir) / "node.log")
        return {
            "Label": self.label,
            "ProgramArguments": list(self.argv),
            "EnvironmentVariables": dict(self.env),
            "RunAtLoad": True,
            "KeepAlive": True,
            "StandardOutPath": log,
            "StandardErrorPath": log,
            "ProcessType": "Interactive",  # full GPU and memory priority for inference
        }

    def _install_launchd(self) -> None:
        self.definition.parent.mkdir(parents=True, exist_ok=True)
        with self.definition.open("wb") as file:
            plistlib.dump(self.launchd_plist(), file)
        self._remove_launchd()  # an agent of this label left loaded would refuse the bootstrap
        _run(["launchctl", "bootstrap", self._launchd_target(), str(self.definition)])

    def _remove_launchd(self) -> None:
        subprocess.run(
            ["launchctl", "bootout", f"{self._launchd_target()}/{self.label}"], capture_output=True
        )

    def _running_launchd(self) -> bool:
        done = subprocess.run(
            ["launchctl", "print", f"{self._launchd_target()}/{self.label}"],
            capture_output=True,
            text=True,
        )
        return done.returncode == 0 and "state = running" in done.stdout

    # -- systemd --user ---------------------------------------------------------------------

    def systemd_unit(self) -> str:
        """The `systemd --user` unit: enabled for default.target, restarted if it dies."""
        import shlex

        env = "".join(f"Environment={shlex.quote(f'{k}={v}')}\n" for k, v in self.env)
        return (
            "[Unit]\nDescription=qwen cluster node " + self.name + "\n\n"
            "[Service]\n" + env + "ExecStart=" + shlex.join(self.argv) + "\n"
            "Restart=always\nRestartSec=2\n"
            f"StandardOutput=append:{self.state_dir}/node.log\n"
            f"StandardError=append:{self.state_dir}/node.log\n\n"
            "[Install]\nWantedBy=default.target\n"
        )

    def _install_systemd(self) -> None:
        self.definition.parent.mkdir(parents=True, exist_ok=True)
        self.definition.write_text(self.systemd_unit())
        # Lingering keeps the user's manager (and the node) running with nobody logged in.
        subprocess.run(["loginctl", "enable-linger"], capture_output=True)
        _run(["systemctl", "--user", "daemon-reload"])
        _run(["systemctl", "--user", "enable", "--now", self.definition.name])

    def _remove_systemd(self) -> None:
        unit = f"{UNIT_PREFIX}{self.name}.service"
        subprocess.run(["systemctl", "--user", "disable", "--now", unit], capture_output=True)
        if self.definition is not None:
            self.definition.unlink(missing_ok=True)
        subprocess.run(["systemctl", "--user", "daemon-reload"], capture_output=True)

    def _running_systemd(self) -> bool:
        unit = f"{UNIT_PREFIX}{self.name}.service"
        done = subprocess.run(["systemctl", "--user", "is-active", unit], capture_output=True)
        return done.returncode == 0

    # -- supervised process -----------------------------------------------------------------

    def _supervisor_pid(self) -> int | None:
        try:
            pid = int((Path(self.state_dir) / PID_FILE).read_text())
        except (OSError, ValueError):
            return None
        try:  # the pid must still be our supervisor (pids are reused)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"cluster.hosts.supervisor" not in cmdline:
                return None
        except FileNotFoundError:
            return None
        except OSError:  # no /proc (macOS without launchd would be odd): trust the signal
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def _install_process(self) -> None:
        argv = [sys.executable, "-m", "cluster.hosts.supervisor", self.state_dir, "--", *self.argv]
        subprocess.Popen(
            argv,
            env={**os.environ, **dict(self.env)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the ssh session: logout and SIGHUP pass it by
            close_fds=True,
        )
        deadline = time.monotonic() + STOP_DEADLINE_S
        while self._supervisor_pid() is None:
            if time.monotonic() > deadline:
                raise ServiceError("the node's supervisor did not start")
            time.sleep(0.05)

    def _remove_process(self) -> None:
        pid = self._supervisor_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_DEADLINE_S
        while self._supervisor_pid() is not None and _alive(pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # its own session and group, the node included
                _wait_for_group_exit(pid)
                break
            time.sleep(0.05)

    def _running_process(self) -> bool:
        return self._supervisor_pid() is not None


def _wait_for_group_exit(pgid: int, timeout_s: float = 5.0) -> None:
    """Waits until no process of the group is left, so that `down` returns with none running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ServiceError(f"{' '.join(argv)} failed: {(done.stderr or done.stdout).strip()}")
