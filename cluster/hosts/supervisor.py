"""A node daemon kept running without a service manager: `python -m cluster.hosts.supervisor`.

Used where neither launchd nor a `systemd --user` manager is there. The supervisor runs in its
own session (so logging out does not end it), restarts the node when it exits (backing off when
it keeps failing), and on SIGTERM stops the node and leaves. Its pid is in `supervisor.pid` in
the node's state directory, which is how `cluster down` finds it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PID_FILE = "supervisor.pid"
MAX_BACKOFF_S = 30.0
STOP_GRACE_S = 5.0


def supervise(state_dir: Path, argv: list[str]) -> int:
    stopping = False
    child: subprocess.Popen | None = None

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the ssh session that started us may end
    (state_dir / PID_FILE).write_text(f"{os.getpid()}\n")
    backoff = 1.0
    try:
        with (state_dir / "node.log").open("ab") as log:
            while not stopping:
                started = time.monotonic()
                child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                # `stopping` is checked here too: a SIGTERM that lands while Popen runs finds no
                # child to stop, and the finally block below must stop this one.
                while child.poll() is None and not stopping:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.wait(timeout=1.0)
                if stopping:
                    break
                backoff = (
                    1.0 if time.monotonic() - started > 60 else min(backoff * 2, MAX_BACKOFF_S)
                )
                log.write(
                    f"node exited with {child.returncode}; restart in {backoff:.0f} s\n".encode()
                )
                log.flush()
                deadline = time.monotonic() + backoff
                while not stopping and time.monotonic() < deadline:
                    time.sleep(0.2)
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        (state_dir / PID_FILE).unlink(missing_ok=True)
    return 0


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(
            "usage: python -m cluster.hosts.supervisor STATE_DIR -- NODE_ARGV...", file=sys.stderr
        )
        return 2
    return supervise(Path(sys.argv[1]), sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
