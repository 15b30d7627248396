"""A phase of the run: the time it may take, and its failure recorded rather than raised."""

from __future__ import annotations

import contextlib
import time
import traceback


@contextlib.contextmanager
def recorded(report: dict, key: str):
    """Record a phase's failure in the report and go on with the next phase."""
    try:
        yield
    except Exception as error:
        report[key] = f"{type(error).__name__}: {error}\n" + traceback.format_exc()[-2000:]
        print(f"  FAILED: {report[key]}", flush=True)


class Deadline:
    """The run's --deadline-s: a phase that needs more than is left is skipped, and says so."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, name: str, need_s: float, report: dict) -> bool:
        if self.left() >= need_s:
            return True
        report.setdefault("skipped", []).append(
            f"{name}: {self.left():.0f} s left, {need_s} needed"
        )
        print(f"== {name}: skipped ({self.left():.0f} s left)", flush=True)
        return False
