"""A bench run on the terminal and on disk: the table, `bench.json`, `bench.csv`, and
`--compare` of two runs side by side.

The JSON holds everything (settings, versions, commit, every node's hardware, every
scenario's figures, node breakdown and requests); the CSV has one row per scenario with its
settings, figures and ratios to the baselines, the same numbers as the JSON.

Each scenario's figures get, beside `acceptance_rate`, the MTP depth the tail chose
(`auto_depth_mean`, `auto_depth0_share`: `metrics.chosen_depth` of the node counters' differences
in its node rows), added here (`complete`) so that the table, the JSON and the CSV show them.
"""

from __future__ import annotations

import csv
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from cluster import __version__
from cluster.bench import metrics, nodes

JSON_NAME = "bench.json"
CSV_NAME = "bench.csv"
SETTING_COLUMNS = ("prompt_tokens", "max_tokens", "requests", "concurrency", "rate",
                   "sampling", "mtp")  # fmt: skip

# (heading, metric key, format) of the terminal table
TABLE: tuple[tuple[str, str, str], ...] = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("tok/s", "output_throughput", "{:.1f}"),
    ("tok/s/str", "per_stream_throughput", "{:.1f}"),
    ("TTFT p50", "median_ttft_ms", "{:.0f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.0f}"),
    ("TPOT", "mean_tpot_ms", "{:.1f}"),
    ("ITL p50", "median_itl_ms", "{:.1f}"),
    ("ITL p99", "p99_itl_ms", "{:.1f}"),
    ("prefill t/s", "prefill_throughput", "{:.0f}"),
    ("accept", "acceptance_rate", "{:.0%}"),
    ("depth", "auto_depth_mean", "{:.2f}"),
    ("depth 0", "auto_depth0_share", "{:.0%}"),
)
COMPARED = ("output_throughput", "per_stream_throughput", "request_throughput",
            "median_ttft_ms", "mean_tpot_ms", "median_itl_ms", "p99_itl_ms",
            "acceptance_rate", "auto_depth_mean", "auto_depth0_share")  # fmt: skip
DEPTH_FIGURES = ("auto_depth_mean", "auto_depth0_share")


def complete(report: dict[str, Any]) -> dict[str, Any]:
    """`report` with each scenario's figures holding the depth the tail chose, right after
    `acceptance_rate`, from its node rows (a copy; figures already there are kept)."""
    scenarios = []
    for scenario in report.get("scenarios", []):
        figures = scenario["metrics"]
        if all(key in figures for key in DEPTH_FIGURES):
            scenarios.append(scenario)
            continue
        depth = metrics.chosen_depth(*nodes.depth_counts(scenario.get("nodes", [])))
        ordered: dict[str, Any] = {}
        for key, value in figures.items():
            ordered[key] = value
            if key == "acceptance_rate":
                ordered |= depth
        scenarios.append({**scenario, "metrics": ordered | depth})
    return {**report, "scenarios": scenarios}


def versions() -> dict[str, Any]:
    """The software measured: this package, MLX, mlx-lm, Python, and the commit."""
    import mlx.core as mx

    try:
        from importlib.metadata import version

        mlx_lm = version("mlx-lm")
    except Exception:  # not installed as a distribution: say so rather than guess
        mlx_lm = "unknown"
    return {
        "cluster": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm,
        "python": sys.version.split()[0],
        "client_platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **source_state(),
    }


def source_state() -> dict[str, Any]:
    """The commit measured and the tracked files that differ from it, when this package runs
    from a git checkout; empty figures otherwise (an installed package has no commit)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return {"commit": "", "modified": []}

    def git(*args: str) -> str:
        try:
            out = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "modified": git("status", "--short", "--untracked-files=no").splitlines(),
    }


def describe_node(node: dict[str, Any]) -> str:
    """'local-0 [0, 4): Apple M2 Ultra, 24 cores, 192.0 GiB, macOS 15.1'"""
    start, end = node["layers"]
    memory = node["memory_total_bytes"] / 2**30
    return (
        f"{node['node_id']} [{start}, {end}): {node['chip'] or '?'}, {node['cpu_count']} cores, "
        f"{memory:.1f} GiB, {node['os'] or '?'}"
    )


def csv_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per scenario: name, settings, every metric, the ratios, then the run's
    model, nodes (hardware), versions and commit, alike on every row."""
    report = complete(report)
    versions = report.get("versions", {})
    run = {
        "model": report.get("model"),
        "nodes": "; ".join(describe_node(n) for n in report.get("hardware", [])),
        **{key: versions.get(key) for key in ("cluster", "mlx", "mlx_lm", "python", "commit")},
        "date": versions.get("date"),
    }
    rows = []
    for scenario in report["scenarios"]:
        row: dict[str, Any] = {"scenario": scenario["name"]}
        row |= {key: scenario["settings"][key] for key in SETTING_COLUMNS}
        row |= scenario["metrics"]
        for baseline, ratios in scenario.get("ratios", {}).items():
            row |= {f"{key}_over_{baseline}": value for key, value in ratios.items()}
        rows.append(row | run)
    return rows


def write(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """bench.json and bench.csv under `out_dir` (created if need be)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = complete(report)
    json_path = out_dir / JSON_NAME
    json_path.write_text(json.dumps(report, indent=2))
    rows = csv_rows(report)
    csv_path = out_dir / CSV_NAME
    with csv_path.open("w", newline="") as handle:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return [json_path, csv_path]


def failed_scenarios(report: dict[str, Any]) -> list[str]:
    """The scenarios whose every request failed (`errors` also holds the follow-up and
    shared-prefix parts' failures)."""
    parts = ("cached_ttft", "shared_prefix_ttft")
    return [name for name in report.get("errors", {}) if name not in parts]


def table(report: dict[str, Any]) -> str:
    """The terminal table: one line per scenario, then each node's share of the work."""
    report = complete(report)
    width = max([len(s["name"]) for s in report["scenarios"]] + [8])
    lines = [f"{report.get('model', '?')} on {len(report.get('hardware', []))} node(s):"]
    lines += [f"  {describe_node(n)}" for n in report.get("hardware", [])]
    head = f"{'scenario':<{width}} " + " ".join(f"{h:>10}" for h, _, _ in TABLE)
    lines += ["", head, "-" * len(head)]
    for scenario in report["scenarios"]:
        cells = [_cell(scenario["metrics"].get(key), fmt) for _, key, fmt in TABLE]
        lines.append(f"{scenario['name']:<{width}} " + " ".join(f"{c:>10}" for c in cells))
        failed = scenario["metrics"]["failed"]
        if failed:
            lines.append(f"  {failed} request(s) failed")
    for name in failed_scenarios(report):
        lines.append(f"{name:<{width}} not measured: {report['errors'][name]}")
    lines.append("")
    lines.append("per node, head first: step ms / busy share / RTT of the hop into it (ms)")
    for scenario in report["scenarios"]:
        parts = [
            f"{n['node_id']} {_cell(n['step_ms'], '{:.1f}')}/"
            f"{_cell(n['busy_share'], '{:.0%}')}/{_cell(n['hop_rtt_ms'], '{:.2f}')}"
            for n in scenario["nodes"]
        ]
        lines.append(f"  {scenario['name']:<{width}} " + "  ".join(parts))
    lines += _first_request_lines(report)
    lines += _cached_lines(report)
    lines += _shared_prefix_lines(report)
    lines += _baseline_lines(report)
    return "\n".join(lines)


def _first_request_lines(report: dict[str, Any]) -> list[str]:
    first = report.get("first_request")
    if not first:
        return []
    warm = ", ".join(f"{t:.0f}" for t in first["warm_ttft_ms"])
    return [
        "",
        f"TTFT of the run's first request (p{first['prompt_tokens']}): {first['ttft_ms']:.0f} ms, "
        f"{_cell(first['over_warm'], '{:.2f}')}x the median of the next "
        f"{len(first['warm_ttft_ms'])} ({warm} ms): what a cold start costs, on a cluster just "
        "started",
    ]


def _cached_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("cached_ttft") or []
    error = report.get("errors", {}).get("cached_ttft")
    if error:
        return ["", f"TTFT of a follow-up turn: not measured ({error})"]
    if not rows:
        return []
    cells = [
        f"p{r['prompt_tokens']}: {_cell(r['cached_ttft_ms'], '{:.0f}')} ms "
        f"({r['cached_tokens']} cached) vs {r['uncached_ttft_ms']:.0f} ms uncached"
        for r in rows
    ]
    return ["", "TTFT of a follow-up turn (conversation cache): " + ", ".join(cells)]


def _shared_prefix_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("shared_prefix_ttft") or []
    error = report.get("errors", {}).get("shared_prefix_ttft")
    if error:
        return ["", f"TTFT of chats sharing a system prompt: not measured ({error})"]
    if not rows:
        return []
    first, later = rows[0], rows[1:]
    cells = [f"first {first['ttft_ms']:.0f} ms ({first['cached_tokens']} cached)"]
    cells += [f"{r['ttft_ms']:.0f} ms ({r['cached_tokens']} cached)" for r in later]
    return [
        "",
        f"TTFT of chats sharing a {first['system_tokens']}-token system prompt: "
        + ", ".join(cells),
    ]


def _baseline_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for name, baseline in report.get("baselines", {}).items():
        if "error" in baseline or "skipped" in baseline:
            lines.append(f"baseline {name}: {baseline.get('error') or baseline.get('skipped')}")
            continue
        figures = ", ".join(
            f"p{r['prompt_tokens']} {r['sampling']}: {r['decode_tps']:.1f} tok/s, "
            f"TTFT {r['ttft_ms']:.0f} ms"
            for r in baseline["runs"]
        )
        lines.append(f"baseline {name} ({baseline['description']}): {figures}")
    if lines:
        lines.insert(0, "")
        lines.append("(ratios to the baselines are in the JSON and CSV: *_over_<baseline>)")
    return lines


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Two runs side by side, scenario by scenario (matched by name): A, B and B / A."""
    a, b = complete(a), complete(b)
    by_name = {s["name"]: s for s in b["scenarios"]}
    lines = [
        f"A: {_describe(a)}",
        f"B: {_describe(b)}",
        f"{'scenario':<32} {'metric':<22} {'A':>10} {'B':>10} {'B/A':>7}",
    ]
    shared = [s for s in a["scenarios"] if s["name"] in by_name]
    for scenario in shared:
        other = by_name[scenario["name"]]
        for key in COMPARED:
            x, y = scenario["metrics"].get(key), other["metrics"].get(key)
            ratio = f"{y / x:.2f}" if x and y is not None else "-"
            lines.append(
                f"{scenario['name']:<32} {key:<22} {_cell(x, '{:.2f}'):>10} "
                f"{_cell(y, '{:.2f}'):>10} {ratio:>7}"
            )
    only = sorted(set(by_name) ^ {s["name"] for s in a["scenarios"]})
    if not shared:
        lines.append("(no scenario in common)")
    if only:
        lines.append(f"in one run only: {', '.join(only)}")
    return "\n".join(lines)


def load(path: Path) -> dict[str, Any]:
    """A bench.json, or a ValueError saying why it is not one."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(report, dict) or not isinstance(report.get("scenarios"), list):
        raise ValueError(f"{path} is not a `cluster bench` JSON (no scenarios)")
    return report


def _describe(report: dict[str, Any]) -> str:
    v = report.get("versions", {})
    nodes = len(report.get("hardware", []))
    model = report.get("model", "?")
    return f"{model} on {nodes} node(s), commit {v.get('commit', '?')}, {v.get('date', '?')}"


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
