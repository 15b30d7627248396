"""What machine a node runs on, as it reports it: chip, operating system, cores.

Read once per process; on a Mac the chip is the marketing name (`Apple M2 Ultra`), elsewhere
the CPU's model name, so a benchmark's table tells the user which box each row is.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Hardware:
    chip: str
    os: str
    cpu_count: int


@functools.cache
def this_machine() -> Hardware:
    return Hardware(chip=_chip(), os=_os_name(), cpu_count=os.cpu_count() or 0)


def _chip() -> str:
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _os_name() -> str:
    if platform.system() == "Darwin":
        return f"macOS {platform.mac_ver()[0]}"
    return f"{platform.system()} {platform.release()}"
