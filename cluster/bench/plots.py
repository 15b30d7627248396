"""The PNG plots of a bench run (matplotlib, the optional `[bench]` extra).

  throughput_vs_concurrency.png  aggregate and per-stream tokens/s against concurrency
  itl_vs_concurrency.png         inter-token latency p50 and p99 against concurrency
  ttft_vs_prompt.png             median time to first token against prompt length
  mtp_on_off.png                 aggregate tokens/s with MTP on and off, side by side

One line per prompt length (or per concurrency) and MTP setting, closed-loop scenarios only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

Scenario = dict[str, Any]


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def draw(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every plot that the run's scenarios support; return their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable("plots need matplotlib: pip install 'qwen-cluster[bench]'") from None
    closed = [s for s in report["scenarios"] if s["settings"]["concurrency"] is not None]
    title = f"{report.get('model', '')} on {len(report.get('hardware', []))} node(s)"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, drawer in _PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        if drawer(ax, closed):
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path)
            written.append(path)
        plt.close(fig)
    return written


def _series(
    scenarios: list[Scenario], line_key: Callable[[Scenario], str], x_key: str
) -> dict[str, list[Scenario]]:
    """Scenarios grouped into lines, each sorted by its x setting."""
    lines: dict[str, list[Scenario]] = defaultdict(list)
    for s in scenarios:
        lines[line_key(s)].append(s)
    return {k: sorted(v, key=lambda s: s["settings"][x_key]) for k, v in sorted(lines.items())}


def _label(s: Scenario, *keys: str) -> str:
    settings = s["settings"]
    parts = []
    if "prompt" in keys:
        parts.append(f"prompt {settings['prompt_tokens']}")
    if "concurrency" in keys:
        parts.append(f"c={settings['concurrency']}")
    parts.append("MTP" if settings["mtp"] else "no MTP")
    parts.append(settings["sampling"])
    return ", ".join(parts)


def _plot_metric(ax, scenarios, line_of, x_key, metric, style="-o", suffix="") -> bool:
    drawn = False
    for label, line in _series(scenarios, line_of, x_key).items():
        points = [(s["settings"][x_key], s["metrics"][metric]) for s in line]
        points = [(x, y) for x, y in points if y is not None]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label + suffix)
            drawn = True
    return drawn


def _throughput(ax, scenarios: list[Scenario]) -> bool:
    def line(s: Scenario) -> str:
        return _label(s, "prompt")

    drawn = _plot_metric(ax, scenarios, line, "concurrency", "output_throughput", "-o")
    _plot_metric(ax, scenarios, line, "concurrency", "per_stream_throughput", "--x", " (/stream)")
    _ticks(ax, scenarios, "concurrency")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens/s (solid: aggregate, dashed: per stream)")
    return drawn


def _itl(ax, scenarios: list[Scenario]) -> bool:
    def line(s: Scenario) -> str:
        return _label(s, "prompt")

    drawn = _plot_metric(ax, scenarios, line, "concurrency", "median_itl_ms", "-o", " p50")
    _plot_metric(ax, scenarios, line, "concurrency", "p99_itl_ms", ":^", " p99")
    _ticks(ax, scenarios, "concurrency")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("inter-token latency (ms)")
    return drawn


def _ttft(ax, scenarios: list[Scenario]) -> bool:
    def line(s: Scenario) -> str:
        return _label(s, "concurrency")

    drawn = _plot_metric(ax, scenarios, line, "prompt_tokens", "median_ttft_ms")
    _ticks(ax, scenarios, "prompt_tokens")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median time to first token (ms)")
    return drawn


def _ticks(ax, scenarios: list[Scenario], key: str) -> None:
    """Ticks at the measured settings, on a log-2 axis (levels and lengths double)."""
    values = sorted({s["settings"][key] for s in scenarios})
    if len(values) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


def _mtp(ax, scenarios: list[Scenario]) -> bool:
    """Bars per (prompt, concurrency, sampling): MTP on beside MTP off."""
    pairs: dict[tuple, dict[bool, float]] = defaultdict(dict)
    for s in scenarios:
        st = s["settings"]
        key = (st["prompt_tokens"], st["concurrency"], st["sampling"])
        pairs[key][st["mtp"]] = s["metrics"]["output_throughput"]
    keys = sorted(k for k, v in pairs.items() if len(v) == 2)
    if not keys:
        return False
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [pairs[k][True] for k in keys], 0.4, label="MTP on")
    ax.bar([x + 0.2 for x in xs], [pairs[k][False] for k in keys], 0.4, label="MTP off")
    ax.set_xticks(list(xs), [f"p{p} c={c}\n{s}" for p, c, s in keys], fontsize=7)
    ax.set_ylabel("aggregate tokens/s")
    return True


_PLOTS: dict[str, Callable[[Any, list[Scenario]], bool]] = {
    "throughput_vs_concurrency": _throughput,
    "itl_vs_concurrency": _itl,
    "ttft_vs_prompt": _ttft,
    "mtp_on_off": _mtp,
}
