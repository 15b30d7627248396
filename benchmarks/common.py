"""What the benchmarks share: prompts, the machine, medians, JSON, local node processes.

Figures here are ratios of variants measured side by side: every benchmark interleaves its
variants round by round (the order shuffled with a fixed seed), so the background load of a
shared machine falls on all of them alike, and reports medians.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from cluster.bench.report import source_state
from cluster.commands.up import local_node_command
from cluster.config import bundled_model_path

# Code prompts in the style the bundled model was trained on (CPython's standard library);
# the last is its chat form ("Show me the source of NAME").
CODE_PROMPTS: tuple[str, ...] = (
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    'class LRUCache:\n    """A mapping that forgets its least recently used keys."""\n\n'
    "    def __init__(self, capacity):\n",
    'def parse_header(line):\n    """Parse a Content-type like header.\n\n',
    "CHAT:Show me the source of textwrap",
)
SAMPLED_TEMPERATURE = 0.7  # the model card: greedy decoding loops on a small model


def encode(tokenizer, prompt: str) -> tuple[int, ...]:
    """Token ids of a prompt (a "CHAT:" prefix applies the chat template)."""
    if prompt.startswith("CHAT:"):
        messages = [{"role": "user", "content": prompt[5:]}]
        return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tuple(tokenizer.encode(prompt))


def load_tokenizer(model_dir: Path):
    from mlx_lm.tokenizer_utils import load

    return load(model_dir)


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "load_average": os.getloadavg(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **source_state(),
    }


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a[i] / b[i] of samples taken side by side (same round, same prompt)."""
    return [x / y for x, y in zip(a, b, strict=True) if y]


def spread(values: Sequence[float]) -> tuple[float, float]:
    """The lower and upper quartile (min and max below 4 samples)."""
    values = sorted(values)
    if len(values) < 4:
        return values[0], values[-1]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def write_json(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {path}")


def default_model() -> Path:
    return bundled_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")
        time.sleep(0.1)


@dataclass
class LocalNodes:
    """`count` node daemons on loopback (`python -m cluster node ...`), stopped on exit."""

    count: int
    token: str = ""

    def __enter__(self) -> LocalNodes:
        self.token = self.token or secrets.token_hex(16)
        self.ports = [free_port() for _ in range(self.count)]
        self.procs = []
        try:
            for i, port in enumerate(self.ports):
                self.procs.append(subprocess.Popen(node_command(port, self.token, f"bench-{i}")))
            for proc, port in zip(self.procs, self.ports, strict=True):
                wait_for_port(port, proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def __exit__(self, *exc: object) -> None:
        stop(self.procs)


def node_command(port: int, token: str, node_id: str) -> list[str]:
    return [*local_node_command(port, node_id), "--token", token]


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes this benchmark started (by their own handles)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_parser(
    module: str, description: str | None, *, json: bool = True, model: bool = True
) -> argparse.ArgumentParser:
    """The parser a `python -m benchmarks.<module>` script starts from: its docstring as the
    help, `--json OUT` and `--model DIR` (the bundled model by default)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{module}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if json:
        parser.add_argument("--json", help="write the results here")
    if model:
        parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    return parser
