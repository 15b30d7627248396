"""The ratios and the short table that end the output."""

from __future__ import annotations

from typing import Any

from benchmarks.common import median


def summarize(report: dict) -> None:
    """Ratios and the short table that ends the output."""
    single = report.get("single", {})
    off = single.get("mtp_off", {}).get("median_tps")
    on = single.get("mtp_on", {}).get("0.7", {}).get("median_tps")
    s: dict[str, Any] = {}
    lines = [
        f"\nGPU bench: {report['machine']['gpu']} | shape {report['shape']}, "
        f"{report['bits']}-bit, random weights | {report['machine']['date']}"
    ]
    ck = report.get("checkpoint", {})
    how = "reused" if ck.get("reused") else f"written in {ck.get('seconds', 0):.0f} s"
    lines.append(f"checkpoint {ck.get('bytes', 0) / 2**30:.2f} GiB ({how})")
    if "steps" in single:
        st, bd, bw, wb = (
            single["steps"],
            single["breakdown"],
            single["bandwidth"],
            single["weights"],
        )
        read = wb["layers"] + wb["lm_head"]
        floor = read / (bw["gb_per_s"] * 1e9) * 1e3
        s["plain_floor_ms"] = floor
        lines.append(
            f"copy bandwidth {bw['gb_per_s']:.0f} GB/s; plain step reads "
            f"{read / 1e9:.2f} GB -> floor {floor:.2f} ms"
        )
        lines.append(
            f"step (ShardRunner.run, whole model): plain {st['plain']['median_ms']:.2f} ms, "
            f"verify [y,d] {st['verify']['median_ms']:.2f} ms -> "
            f"{st['verify_over_plain']:.2f}x"
        )
        b1, b2 = bd["backbone_1tok"], bd["backbone_2tok"]
        lines.append(
            f"  backbone 1 tok {b1['total_ms']:.2f} ms (graph build {b1['build_ms']:.2f}), "
            f"2 tok {b2['total_ms']:.2f} ms (build {b2['build_ms']:.2f}); "
            f"lm_head+argmax {bd['lm_head_argmax_ms']:.2f} ms; "
            f"MTP head {bd.get('mtp_head_ms', float('nan')):.2f} ms"
        )
    interleaved = report.get("interleaved", {}).get("summary", {})
    for i, (name, v) in enumerate(interleaved.items()):
        s[f"interleaved {name}"] = v
        lines.append(
            f"interleaved [{name}]: plain {v['plain_ms']['median']:.2f} ms, verify/plain "
            f"{v['verify_over_plain']:.2f}x, MTP off {v['mtp_off_tps']['median']:.1f} tok/s, "
            f"on a=0.7 {v['mtp_on_tps']['median']:.1f}"
            + (
                ""
                if i == 0
                else "; over the first, medians of rounds: "
                + ", ".join(f"{k} {r['over_first']:.3f}x" for k, r in v.items() if type(r) is dict)
            )
        )
    for name, v in single.get("variants", {}).items():
        st, b1 = v["steps"], v["breakdown"]["backbone_1tok"]
        v_off, v_on = v["mtp_off"]["median_tps"], v["mtp_on"]["0.7"]["median_tps"]
        per_token = 1e3 / v_off
        s[f"variant {name}"] = {
            "plain_ms": st["plain"]["median_ms"],
            "verify_over_plain": st["verify_over_plain"],
            "engine_ms_per_token_over_step": per_token / st["plain"]["median_ms"],
            "engine_over_its_steps": v["mtp_off"].get("engine_over_steps"),
            "mtp_off_tps": v_off,
            "mtp_on_tps": v_on,
        }
        lines.append(
            f"[{name}] plain {st['plain']['median_ms']:.2f} ms (build {b1['build_ms']:.2f} of "
            f"{b1['total_ms']:.2f}), verify/plain {st['verify_over_plain']:.2f}x; engine off "
            f"{v_off:.1f} tok/s = {per_token:.2f} ms/token = "
            f"{per_token / st['plain']['median_ms']:.2f}x the step timed above, "
            f"{v['mtp_off'].get('engine_over_steps') or float('nan'):.3f}x its own steps; "
            f"on a=0.7 {v_on:.1f} "
            f"({v['mtp_on']['0.7'].get('engine_over_steps') or float('nan'):.3f}x its own steps)"
            + "".join(
                f"; depth {d} {r['median_tps']:.1f}" for d, r in v.get("mtp_depths", {}).items()
            )
        )
    if off:
        row = f"engine, 1 process: MTP off {off:.1f} tok/s"
        for alpha, r in single["mtp_on"].items():
            row += f" | on a={alpha} {r['median_tps']:.1f} ({r['over_off']:.2f}x)"
        lines.append(row)
        s["single_on_over_off_0.7"] = on / off if on else None
        for key in ("concurrent", "concurrent_compiled"):
            if on and key in single:
                c = single[key]
                s[f"single_{key}_over_one"] = c["aggregate_tps"] / on
                lines.append(
                    f"  {c['requests']} concurrent MTP on a=0.7 ({key}): "
                    f"{c['aggregate_tps']:.1f} tok/s, {c['aggregate_tps'] / on:.2f}x one request "
                    f"(the first batch: {c['first_batch']['aggregate_tps']:.1f} tok/s)"
                )
    lm = report.get("mlx_lm", {}).get("median_tps")
    if lm and off and on:
        s["single_off_over_mlx_lm"] = off / lm
        lines.append(
            f"mlx-lm stream_generate {lm:.1f} tok/s; ours MTP off / mlx-lm {off / lm:.2f}x, "
            f"MTP on a=0.7 / mlx-lm {on / lm:.2f}x"
        )
    for n, row in report.get("nodes", {}).items():
        if "error" in row or not (off and on):
            lines.append(f"{n} nodes: {row.get('error', 'no single-process figure')!s:.300}")
            continue
        a, b = row["mtp_off"]["median_tps"], row["mtp_on"]["median_tps"]
        s[f"nodes{n}_off_over_single"] = a / off
        s[f"nodes{n}_on_over_single"] = b / on
        s[f"nodes{n}_on_over_off"] = b / a
        lines.append(
            f"{n} nodes: off {a:.1f} tok/s ({a / off:.2f}x 1 proc), on a=0.7 {b:.1f} "
            f"({b / on:.2f}x 1 proc), on/off {b / a:.2f}x; node step ms "
            f"{[round(x, 2) for x in row['mtp_off']['node_step_ms']]}"
        )
        if lm:
            s[f"nodes{n}_on_over_mlx_lm"] = b / lm
            lines.append(f"  {n} nodes MTP on / mlx-lm one process {b / lm:.2f}x")
        if "steps" in single:
            # Each node's step against its layers' share of the one-process plain step.
            share = single["steps"]["plain"]["median_ms"] / int(n)
            shares = [x / share for x in row["mtp_off"]["node_step_ms"]]
            s[f"nodes{n}_step_over_share"] = shares
            lines.append(f"  node step / its share of the 1-process step {_fmt(shares)}")
        if "concurrent" in row:
            c = row["concurrent"]
            s[f"nodes{n}_concurrent_over_one"] = c["aggregate_tps"] / b
            lines.append(
                f"  {c['requests']} concurrent MTP on: {c['aggregate_tps']:.1f} tok/s, "
                f"{c['aggregate_tps'] / b:.2f}x one request (the first batch: "
                f"{c['first_batch']['aggregate_tps']:.1f} tok/s)"
            )
    for attempt in report.get("mlx_pipeline", []):
        how = "comm on CPU stream" if attempt["cpu_comm"] else "as is"
        if "median_tps" in attempt:
            ours = report.get("nodes", {}).get("2", {}).get("mtp_off", {}).get("median_tps")
            rel = f"; ours 2 nodes MTP off / it {ours / attempt['median_tps']:.2f}x" if ours else ""
            s[f"mlx_pipeline_{'cpu' if attempt['cpu_comm'] else 'gpu'}_tps"] = attempt["median_tps"]
            lines.append(
                f"mlx-lm pipeline ring 2 ranks ({how}): {attempt['median_tps']:.1f} tok/s{rel}"
            )
        else:
            lines.append(f"mlx-lm pipeline ring 2 ranks ({how}): FAILED: {attempt['error'][:300]}")
    paired_out = report.get("paired", {})
    if paired_out.get("ratios"):
        n = paired_out["nodes"]
        r = paired_out["ratios"]
        s["paired"] = {**r, "node_step_over_share": paired_out["node_step_over_share"]}
        lines.append(
            f"side by side, median of {len(paired_out['rounds'])} rounds' ratios: one process "
            f"MTP off / mlx-lm {r['one_process_off_over_mlx_lm']:.2f}x, MTP on a=0.7 / mlx-lm "
            f"{r['one_process_on_over_mlx_lm']:.2f}x (on/off {r['one_process_on_over_off']:.2f}x)"
            f"; engine MTP off / its own steps {r['one_process_engine_over_its_steps']:.3f}x"
        )
        lines.append(
            f"  steps built ahead: MTP off {r['one_process_lookahead_on_over_off']:.2f}x without "
            f"them; without them / mlx-lm {r['one_process_no_lookahead_over_mlx_lm']:.2f}x, "
            f"engine / its own steps {r['one_process_engine_over_steps_no_lookahead']:.3f}x; "
            f"MTP on built before the verdict / waiting for it "
            f"{r['one_process_mtp_ahead_over_waiting']:.2f}x; engine MTP on / its own steps "
            f"{r['one_process_on_engine_over_its_steps']:.3f}x"
        )
        if n:
            lines.append(
                f"  {n} nodes MTP off / one process {r['nodes_off_over_one_process']:.2f}x; "
                f"MTP on / mlx-lm {r['nodes_on_over_mlx_lm']:.2f}x (on/off "
                f"{r['nodes_on_over_off']:.2f}x); node step / its share of the one-process step "
                f"{_fmt(paired_out['node_step_over_share'])}"
            )
            t = paired_out["nodes_off_token_ms"]
            s["paired"]["nodes_off_token_ms"] = t
            lines.append(
                f"  a token over {n} nodes, MTP off: {t['token']:.2f} ms, the node steps "
                f"{t['node_steps']:.2f} and the rest {t['outside_steps']:.2f} (one process's step "
                f"{t['one_process_step']:.2f})"
            )
            for k, phases in enumerate(paired_out["node_phases_ms"]):
                parts = ", ".join(f"{name} {ms:.2f}" for name, ms in phases.items())
                used, undone = paired_out["node_steps_ahead"][k]
                lines.append(
                    f"  node {k} step phases, ms: {parts}; steps built ahead used {used}, "
                    f"undone {undone}"
                )
            for name, spun in paired_out.get("by_set", {}).items():
                s["paired"].setdefault("by_set", {})[name] = spun
                lines.append(
                    f"  node set {name}: MTP off / one process "
                    f"{spun['nodes_off_over_one_process']:.2f}x, node step / its share "
                    f"{_fmt(spun['node_step_over_share'])}, steps built ahead (used, undone) "
                    f"{spun['node_steps_ahead']}"
                )
        if c := paired_out.get("concurrent"):
            s["paired"]["concurrent_one_process_over_one_request"] = c[
                "one_process_over_one_request"
            ]
            lines.append(
                f"  {c['requests']} concurrent MTP on in one process: "
                f"{median(c['one_process']):.1f} tok/s, "
                f"{c['one_process_over_one_request']:.2f}x one request; MTP steps built "
                f"before their verdicts / waiting {c['one_process_mtp_ahead_over_waiting']:.2f}x"
            )
        if c and (over := c.get("nodes_over_one_request")):
            s["paired"]["concurrent_over_one_request"] = over
            lines.append(
                f"  {c['requests']} concurrent MTP on over {n} nodes / one request: "
                f"micro-batched {over['micro_batched']:.2f}x, one batch {over['one_batch']:.2f}x"
            )
    for skipped in report.get("skipped", []):
        lines.append(f"skipped {skipped}")
    report["summary"] = s
    print("\n".join(lines), flush=True)


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}x" for v in values) + "]"
