"""MTP on and off, at depths 0..4 and `auto`, against mlx-lm, on the bundled model in one run.

    python -m benchmarks.mtp_depth_bench [--json OUT] [--rounds 3] [--max-tokens 96]
        [--sampling greedy,sampled] [--no-mlx-lm]

Part 1, end to end. The in-process engine decodes the code prompts of benchmarks.common
(the style of the model's training text, none of them the tests' prompts), stop tokens
ignored, once per variant per round and sampling mode (greedy; sampled at the model card's
temperature, a fixed seed per round and prompt), variants interleaved in a shuffled order:
`off` (the request's `mtp` off), depths 0..4 (depth 0 feeds the MTP head but never drafts),
`auto`, `1-waits`: depth 1 with each step waiting for its verdict before the next one is
built (`ShardRunner.mtp_lookahead` off; `1` is the backend's default), and `mlx-lm`: mlx-lm's
`stream_generate` on the same directory, prompts and seeds. Decode tokens/s is tokens after
the first over the time after the first, by wall clock and by process CPU time (which a busy
shared machine disturbs less; mlx-lm overlaps graph building with compute on a second thread,
which the wall clock rewards and CPU time does not); ratios over `off` are medians of
per-(round, prompt) ratios. Acceptance by depth: accepted / drafted, tokens per decode step,
and the conditional rate at each draft position (the chance that draft i passes when the
drafts before it did).

Part 2, the cost of a step by number of positions on this machine: a bare whole-model runner
steps one request of P = 1..9 positions ([y, d1..d_{P-1}], the request drafting P-1 for its
next step), all kinds interleaved call by call, medians. Beside it the same positions with no
drafts (so no GatedDeltaNet snapshots): the cost of keeping the states; and mlx-lm's own
forward of 1 and 2 tokens on a warm cache, what its speculative decoding would pay. With
acceptance a, depth 1 emits 1 + a tokens a step, so it predicts (1 + a) / (step of 2 / step
of 1) over off, printed beside part 1's measured ratio.

Part 3, keep or recompute. A rejection restores the GatedDeltaNet state at the last kept
position. Keeping costs memory (one state per draft position per layer: the bytes are
printed for this model and for Qwen3.5-27B's shape) and, on the ops path, no compute (part
2). Recomputing instead would store the step's per-position inputs and re-run the recurrence
over the kept positions at the next step: its time is measured here on this model's shape.

Part 4, a prediction (not a measurement) for a machine where a step is bound by reading the
weights, so that a step over up to 8 positions costs what one costs: each draft then costs
one MTP link (the MTP layer and an lm_head row), c of a plain step, and depth k gives
E(k) / (1 + k c) over no MTP, with E(k) from the acceptances measured in part 1.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gated_delta import _gated_delta_step_ops

from benchmarks.common import (
    CODE_PROMPTS,
    SAMPLED_TEMPERATURE,
    bench_parser,
    default_model,
    encode,
    load_tokenizer,
    machine,
    median,
    paired_ratios,
    spread,
    write_json,
)
from benchmarks.stepping import LMForward, SteppedRequests, bare_runner, interleaved
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.decode.mtp_depth import AUTO_MAX_DEPTH
from cluster.decode.runner import ShardRunner, mtp_lookahead_default
from cluster.messages import RequestOptions, SamplingParams

WAITING = "1-waits"
AHEAD = "1-ahead"  # depth 1 with each step built ahead of its verdict, whatever the backend
MLX_LM = "mlx-lm"
VARIANTS = ("off", "0", "1", WAITING, "2", "3", "4", "auto", MLX_LM)
MODES = {"greedy": 0.0, "sampled": SAMPLED_TEMPERATURE}
GREEDY = SamplingParams()
MAX_POSITIONS = 9
# Qwen3.5-27B at 4 bits, measured on a GPU (BENCHMARKS.md): a plain step reads 13.70 GB of layers
# and 0.72 GB of lm_head over 64 layers; an MTP link reads one layer's share and the lm_head.
STEP_GB_27B, LAYERS_GB_27B, LM_HEAD_GB_27B, LAYERS_27B = 14.42, 13.70, 0.72, 64
GDN_27B = {"layers": 48, "v_heads": 48, "k_heads": 16, "head_dim": 128, "conv_kernel": 4}


@dataclass(frozen=True, slots=True)
class Run:
    variant: str
    round: int
    prompt: int
    tokens: int
    decode_tps: float
    cpu_tps: float
    drafted: int
    accepted: int
    verdicts: tuple[tuple[int, int], ...]  # (drafts verified, accepted) of each decode step
    mode: str = "greedy"
    gaps: tuple[float, ...] = ()  # seconds between the chunks of the stream
    cpu_gaps: tuple[float, ...] = ()  # the process's CPU seconds between them


def _options(variant: str, sampling: SamplingParams) -> RequestOptions:
    if variant == "off":
        return RequestOptions(sampling, mtp=False)
    if variant == "auto":
        return RequestOptions(sampling, mtp_depth="auto")
    return RequestOptions(sampling, mtp_depth=int(variant.split("-")[0]))


async def _decode(
    engine: GenerationEngine, ids, variant: str, max_tokens: int, sampling: SamplingParams
) -> Run:
    stamps: list[tuple[float, float]] = []
    tokens, verdicts, drafted, accepted, chunk = 0, [], 0, 0, None
    request = GenerationRequest(ids, max_tokens, _options(variant, sampling))
    async for chunk in engine.stream(request):
        stamps.append((time.perf_counter(), time.process_time()))
        tokens += len(chunk.tokens)
        if len(stamps) > 1:
            verdicts.append((chunk.drafted - drafted, chunk.accepted - accepted))
        drafted, accepted = chunk.drafted, chunk.accepted
    (w0, c0), (w1, c1) = stamps[0], stamps[-1]
    after = tokens - 1
    gaps = tuple(b[0] - a[0] for a, b in itertools.pairwise(stamps))
    cpu_gaps = tuple(b[1] - a[1] for a, b in itertools.pairwise(stamps))
    return Run(
        variant, 0, 0, tokens, after / (w1 - w0), after / (c1 - c0), chunk.drafted,
        chunk.accepted, tuple(verdicts), gaps=gaps, cpu_gaps=cpu_gaps,
    )  # fmt: skip


def _mlx_lm_decode(lm, ids, max_tokens: int, sampling: SamplingParams) -> Run:
    """mlx-lm's `stream_generate`, timed as `_decode` times the engine (one token a step)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = lm
    mx.random.seed(sampling.seed or 0)
    sampler = make_sampler(sampling.temperature)
    stamps = [
        (time.perf_counter(), time.process_time())
        for _ in stream_generate(
            model, tokenizer, list(ids), max_tokens=max_tokens, sampler=sampler
        )
    ]
    (w0, c0), (w1, c1) = stamps[0], stamps[-1]
    after = len(stamps) - 1
    return Run(MLX_LM, 0, 0, len(stamps), after / (w1 - w0), after / (c1 - c0), 0, 0,
               ((0, 0),) * after)  # fmt: skip


async def measure_runs(
    model_dir: Path, prompts, args, lm, variants: tuple[str, ...] = VARIANTS
) -> list[Run]:
    """Every variant on every prompt, in each sampling mode of `args.sampling`, interleaved;
    `lm`: mlx-lm's (model, tokenizer) on the same directory."""
    rounds, max_tokens = args.rounds, args.max_tokens
    local = await open_local_engine(model_dir, mtp=True)
    order = random.Random(13)
    runs: list[Run] = []

    async def decode(ids, variant: str, max_tokens: int, sampling=GREEDY) -> Run:
        if variant == MLX_LM:
            return _mlx_lm_decode(lm, ids, max_tokens, sampling)
        set_lookahead(local, variant)
        return await _decode(local.engine, ids, variant, max_tokens, sampling)

    try:
        for variant in variants:  # warm-up: compile and allocate
            await decode(prompts[0], variant, 8)
        for r in range(rounds):
            for p, ids in enumerate(prompts):
                for mode in args.sampling:
                    sampling = SamplingParams(temperature=MODES[mode], seed=1000 * r + p)
                    shuffled = list(variants)
                    order.shuffle(shuffled)
                    for variant in shuffled:
                        run = await decode(ids, variant, max_tokens, sampling)
                        runs.append(Run(**{**asdict(run), "round": r, "prompt": p, "mode": mode}))
            print(f"round {r + 1}/{rounds} done", flush=True)
    finally:
        local.close()
    return runs


def conditional_rates(verdicts) -> list[float | None]:
    """The chance that draft i passes when the drafts before it passed, from all verdicts."""
    judged: list[int] = []
    passed: list[int] = []
    for drafts, accepted in verdicts:
        while len(judged) < drafts:
            judged.append(0)
            passed.append(0)
        for i in range(min(accepted + 1, drafts)):
            judged[i] += 1
            passed[i] += i < accepted
    return [p / j if j else None for p, j in zip(passed, judged, strict=True)]


def expected_tokens(rates: list[float | None], depth: int) -> float:
    total, reach = 1.0, 1.0
    for rate in rates[:depth]:
        reach *= rate or 0.0
        total += reach
    return total


def summarize_runs(runs: list[Run], mode: str = "greedy") -> dict:
    """Each variant's figures in one sampling mode, by variant."""
    runs = [r for r in runs if r.mode == mode]
    off = {(r.round, r.prompt): r for r in runs if r.variant == "off"}
    out = {}
    for variant in [v for v in VARIANTS if any(r.variant == v for r in runs)]:
        mine = [r for r in runs if r.variant == variant]
        verdicts = [v for r in mine for v in r.verdicts]
        drafted = sum(r.drafted for r in mine)
        histogram: dict[int, int] = {}
        for drafts, _ in verdicts:
            histogram[drafts] = histogram.get(drafts, 0) + 1
        row = {
            "decode_tps": median(r.decode_tps for r in mine),
            "cpu_tps": median(r.cpu_tps for r in mine),
            "tokens_per_step": sum(r.tokens - 1 for r in mine) / max(len(verdicts), 1),
            "acceptance": sum(r.accepted for r in mine) / drafted if drafted else None,
            "drafted": drafted,
            "drafts_per_step": dict(sorted(histogram.items())),
            "conditional_rates": conditional_rates(verdicts),
        }
        for clock in ("decode_tps", "cpu_tps"):
            ratios = paired_ratios(
                [getattr(r, clock) for r in mine],
                [getattr(off[(r.round, r.prompt)], clock) for r in mine],
            )
            row[f"{clock}_over_off"] = (median(ratios), *spread(ratios))
        out[variant] = row
    return out


# ---- part 2: a step by number of positions ----


def measure_steps(runner: ShardRunner, ids: tuple[int, ...], iters: int, lm_model=None) -> dict:
    """Median ms of a whole-model step of 1..MAX_POSITIONS positions (the tail's verify and
    drafts included), and of the backbone alone over as many positions, interleaved; with
    `lm_model`, mlx-lm's forward of 1 and 2 tokens among them."""
    hidden = runner.shard.hidden_size
    x = [mx.random.normal((1, p, hidden)).astype(mx.bfloat16) for p in range(MAX_POSITIONS + 1)]
    mx.eval(x[1:])
    kinds: dict[tuple[str, int], Callable[[], float]] = {}
    for p in range(1, MAX_POSITIONS + 1):
        kinds[("step", p)] = SteppedRequests(runner, ids, depth=p - 1, name=f"p{p}")
        kinds[("backbone", p)] = functools.partial(_time_backbone, runner, x[p], p)
    if lm_model is not None:
        for p in (1, 2):
            kinds[(MLX_LM, p)] = LMForward(lm_model, ids, tokens=p)
    times = interleaved(kinds, iters, warmup=3, seed=5)
    out = {}
    for kind in ("step", "backbone", MLX_LM):
        if (kind, 1) not in times:
            continue
        one = median(times[(kind, 1)])
        out[kind] = {
            p: {"ms": median(t) * 1000, "over_1": median(t) / one, "per_row": median(t) / one / p}
            for (k, p), t in sorted(times.items())
            if k == kind
        }
    return out


# ---- part 3: keep the GatedDeltaNet states, or recompute them ----


def measure_keep_and_recompute(runner: ShardRunner, iters: int) -> dict:
    """The backbone over P positions on a fresh cache, snapshots at every draft position or
    none; and the recurrence alone over r positions, all GDN layers: what a recompute adds."""
    shard = runner.shard
    hidden = shard.hidden_size
    gdn = [layer.linear_attn for layer in shard.layers if layer.is_linear]
    out: dict = {"snapshot": {}, "recompute": {}}
    order = random.Random(7)
    kinds = [("keep", p) for p in range(2, 6)] + [("none", p) for p in range(2, 6)]
    kinds += [("recurrence", r) for r in range(1, 5)]
    times: dict[tuple[str, int], list[float]] = {k: [] for k in kinds}
    key = mx.random.key(0)
    x = {p: mx.random.normal((1, p, hidden), key=key).astype(mx.bfloat16) for p in range(2, 6)}
    mx.eval(list(x.values()))
    for i in range(iters + 2):
        order.shuffle(kinds)
        for kind, n in kinds:
            elapsed = (
                _time_recurrence(gdn, n)
                if kind == "recurrence"
                else _time_backbone(runner, x[n], 1 if kind == "keep" else n)
            )
            if i >= 2:
                times[(kind, n)].append(elapsed)
    for p in range(2, 6):
        keep, none = median(times[("keep", p)]), median(times[("none", p)])
        out["snapshot"][p] = {"keep_ms": keep * 1000, "none_ms": none * 1000, "ratio": keep / none}
    for r in range(1, 5):
        out["recompute"][r] = {"ms": median(times[("recurrence", r)]) * 1000}
    out["state_bytes_per_position"] = {
        "this_model": _state_bytes(len(gdn), gdn[0]) if gdn else 0,
        "qwen3_5_27b": _state_bytes_27b(),
    }
    out["recompute_input_bytes_per_position_27b"] = _input_bytes_27b()
    return out


def _time_backbone(runner: ShardRunner, x: mx.array, n_confirmed: int) -> float:
    from cluster.model.cache import RequestCache
    from cluster.model.layers import Segment

    cache = RequestCache.for_layers(runner.shard.linear_flags)
    cache.begin_step(0, x.shape[1])
    t0 = time.perf_counter()
    mx.eval(runner.shard(x, [Segment(cache, x.shape[1], n_confirmed)]))
    return time.perf_counter() - t0


def _time_recurrence(layers, positions: int) -> float:
    """The gated delta recurrence of every GDN layer over `positions`, from inputs at hand."""
    layer = layers[0]
    hv, hk, dv, dk = layer.num_v_heads, layer.num_k_heads, layer.head_v_dim, layer.head_k_dim
    key = mx.random.key(1)
    q = mx.random.normal((1, positions, hv, dk), key=key)
    k, v = q, mx.random.normal((1, positions, hv, dv), key=key)
    g = beta = mx.full((1, positions, hv), 0.5)
    state = mx.zeros((1, hv, dv, dk))
    mx.eval(q, v, g, state)
    del hk
    t0 = time.perf_counter()
    outs = []
    for _ in layers:
        s = state
        for t in range(positions):
            _, s = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(s)
    mx.eval(outs)
    return time.perf_counter() - t0


def _state_bytes(n_layers: int, layer) -> int:
    conv = layer.conv_dim * (layer.conv_kernel_size - 1) * 2  # bf16
    recurrent = layer.num_v_heads * layer.head_v_dim * layer.head_k_dim * 4  # float32
    return n_layers * (conv + recurrent)


def _state_bytes_27b() -> int:
    s = GDN_27B
    conv_dim = (2 * s["k_heads"] + s["v_heads"]) * s["head_dim"]
    conv = conv_dim * (s["conv_kernel"] - 1) * 2
    recurrent = s["v_heads"] * s["head_dim"] ** 2 * 4
    return s["layers"] * (conv + recurrent)


def _input_bytes_27b() -> int:
    """q, k, v (bf16) and g, beta (float32) of one position, all GDN layers."""
    s = GDN_27B
    qkv = (2 * s["k_heads"] + s["v_heads"]) * s["head_dim"] * 2
    return s["layers"] * (qkv + 2 * s["v_heads"] * 4)


# ---- part 4: the prediction ----


def predict_bandwidth_bound(rates: list[float | None]) -> dict:
    link = (LAYERS_GB_27B / LAYERS_27B + LM_HEAD_GB_27B) / STEP_GB_27B
    return {
        "mtp_link_over_step": link,
        "speedup_by_depth": {
            k: expected_tokens(rates, k) / (1 + k * link) for k in range(1, len(rates) + 1)
        },
    }


def steps_and_keep(runner: ShardRunner, ids: tuple[int, ...], iters: int, lm_model=None) -> dict:
    """Parts 2 and 3, printed."""
    steps = measure_steps(runner, ids, iters, lm_model)
    print("\npositions  step ms (over 1, per row)     backbone alone ms (over 1, per row)")
    for p in steps["step"]:
        a, b = steps["step"][p], steps["backbone"][p]
        print(
            f"{p:9d}  {a['ms']:7.2f} ({a['over_1']:5.2f}x, {a['per_row']:4.2f}x)"
            f"  {b['ms']:7.2f} ({b['over_1']:5.2f}x, {b['per_row']:4.2f}x)"
        )
    if MLX_LM in steps:
        lm = steps[MLX_LM]
        print(
            f"mlx-lm forward: 1 token {lm[1]['ms']:.2f} ms, 2 tokens {lm[2]['ms']:.2f} ms "
            f"({lm[2]['over_1']:.2f}x); the engine's plain step over mlx-lm's 1 token: "
            f"{steps['step'][1]['ms'] / lm[1]['ms']:.2f}x"
        )
    keep = measure_keep_and_recompute(runner, iters)
    print("backbone over P positions, snapshots kept at each draft / none:")
    for p, row in keep["snapshot"].items():
        print(f"  P={p}: {row['keep_ms']:.2f} / {row['none_ms']:.2f} ms ({row['ratio']:.3f}x)")
    print("recurrence of every GDN layer over r positions (what a recompute adds):")
    for r, row in keep["recompute"].items():
        print(f"  r={r}: {row['ms']:.2f} ms")
    sb = keep["state_bytes_per_position"]
    print(
        f"state kept per draft position: {sb['this_model'] / 1e6:.2f} MB here, "
        f"{sb['qwen3_5_27b'] / 1e6:.1f} MB at the 27B shape (inputs a recompute would keep: "
        f"{keep['recompute_input_bytes_per_position_27b'] / 1e6:.2f} MB)"
    )

    return {"step_by_positions": steps, "keep_or_recompute": keep}


ORACLE_VARIANTS = ("off", "1", "2", "3", "auto")


def set_lookahead(local, variant: str) -> None:
    """Build MTP steps ahead of their verdict as the backend does by default (`1`), never
    (`1-waits`) or always (`1-ahead`)."""
    ahead = variant == AHEAD or (mtp_lookahead_default() and variant != WAITING)
    for runner in local.runners:
        runner.mtp_lookahead = ahead


async def oracle_table(
    model_dir: Path,
    prompt: tuple[int, ...],
    rates: list[float],
    rounds: int,
    max_tokens: int,
    variants: tuple[str, ...] = ORACLE_VARIANTS,
) -> dict:
    """Part 4: decode tokens/s at fixed acceptance rates. The tail's verdict on each draft is
    drawn at the rate (`benchmarks.oracle_node`'s oracle) instead of tested, so the rate holds
    whatever the weights are; variants in a shuffled order each round, greedy. Returns, per
    rate, each variant's median tokens/s and its median ratio over off within a round."""
    from benchmarks.oracle_node import install_oracle, remove_oracle

    order = random.Random(17)
    table: dict = {}
    local = await open_local_engine(model_dir, mtp=True)
    try:
        # Warm-up: every shape a variant may step in, `auto`'s deepest included, built once
        # and timed a few times (what `auto` reads), as a server's warm-up does.
        for depth in range(1, AUTO_MAX_DEPTH + 1):
            await _decode(local.engine, prompt, str(depth), 16, GREEDY)
        await _decode(local.engine, prompt, "off", 16, GREEDY)
        for rate in rates:
            previous = install_oracle(rate, seed=int(rate * 100))
            try:
                tps: dict[str, list[float]] = {v: [] for v in variants}
                auto_runs: list[Run] = []
                gaps: dict[str, list[float]] = {v: [] for v in variants}
                profiles: list[dict] = []
                for _ in range(rounds):
                    shuffled = list(variants)
                    order.shuffle(shuffled)
                    for variant in shuffled:
                        set_lookahead(local, variant)
                        run = await _decode(local.engine, prompt, variant, max_tokens, GREEDY)
                        tps[variant].append(run.decode_tps)
                        gaps[variant].extend(run.gaps[1:])
                        profiles.append(step_profile(run) | {"round": len(tps[variant]) - 1})
                        if variant == "auto":
                            auto_runs.append(run)
            finally:
                remove_oracle(previous)
            table[str(rate)] = {
                v: {
                    "tps": median(tps[v]),
                    "over_off": median(paired_ratios(tps[v], tps["off"])),
                }
                for v in variants
            }
            # `auto` against the best fixed depth (and plain decoding) of the same round: a
            # host whose steps run at one of two speeds run by run (an H200 host's plain steps
            # took 17 or 27 ms, MTP off's too) disturbs a ratio of medians, not a pairing.
            row = "  ".join(f"{v} {table[str(rate)][v]['over_off']:.2f}x" for v in variants)
            if "auto" in variants:
                depths = [v for v in variants if v not in ("off", "auto", AHEAD, WAITING)]
                best = max([*depths, "off"], key=lambda v: median(tps[v]))
                auto = table[str(rate)]["auto"]
                auto["best_fixed"] = best
                auto["over_best"] = median(paired_ratios(tps["auto"], tps[best]))
                auto["choices"] = auto_choices(auto_runs)
                row += f"  (auto {auto['over_best']:.2f}x {best}, paired by round)"
            table[str(rate)]["rounds"] = {v: [round(t, 2) for t in tps[v]] for v in tps}
            # Each auto step: (drafts, wall ms since the last token, CPU ms), to see where it
            # loses; each run's plain and drafting steps, wall and CPU (a host-side slowdown
            # raises both, a wait on the device only the first).
            table[str(rate)]["auto_steps"] = [
                [
                    (d, round(g * 1e3, 1), round(c * 1e3, 1))
                    for (d, _), g, c in zip(run.verdicts, run.gaps, run.cpu_gaps, strict=False)
                ]
                for run in auto_runs
            ]
            table[str(rate)]["runs"] = profiles
            table[str(rate)]["round_cost"] = _round_curve(local)
            table[str(rate)]["median_gap_ms"] = {
                v: round(median(g) * 1e3, 2) for v, g in gaps.items() if g
            }
            print(f"acceptance {rate:.1f}: {row}", flush=True)
            if "auto" in variants:
                print(f"  auto: {table[str(rate)]['auto']['choices']}", flush=True)
    finally:
        local.close()
    return table


def _round_curve(local) -> dict:
    """The tail's round-cost curve as `auto` reads it: {bucket: {positions: [ms, samples]}}."""
    tail = local.engine.pipeline.runners[-1]
    return {
        str(b): {str(p): [round(s * 1e3, 2), n] for p, (s, n) in curve.items()}
        for b, curve in tail.rounds.cost.curve().items()
    }


def step_profile(run: Run) -> dict:
    """A run's decode steps by kind: how many, and their median wall and CPU milliseconds
    (the first gap, after the prompt's last chunk, left out)."""
    kinds: dict[str, list[tuple[float, float]]] = {"plain": [], "drafting": []}
    steps = zip(run.verdicts, run.gaps[1:], run.cpu_gaps[1:], strict=False)
    for (drafted, _), wall, cpu in steps:
        kinds["drafting" if drafted else "plain"].append((wall, cpu))
    profile: dict = {"variant": run.variant, "tps": round(run.decode_tps, 2)}
    for kind, steps_of_kind in kinds.items():
        if steps_of_kind:
            profile[kind] = {
                "steps": len(steps_of_kind),
                "wall_ms": round(median([w for w, _ in steps_of_kind]) * 1e3, 2),
                "cpu_ms": round(median([c for _, c in steps_of_kind]) * 1e3, 2),
            }
    return profile


def auto_choices(runs: list[Run]) -> dict:
    """What `auto` chose over its runs: the mean drafts a step, the share of steps without
    drafts, and its slowest steps against its median one (a step that builds a new shape
    stands out there)."""
    drafted = [d for run in runs for d, _ in run.verdicts]
    gaps = sorted(g for run in runs for g in run.gaps)
    mid = median(gaps) if gaps else 0.0
    return {
        "mean_depth": sum(drafted) / max(len(drafted), 1),
        "plain_share": sum(d == 0 for d in drafted) / max(len(drafted), 1),
        "slowest_over_median": [round(g / mid, 1) for g in gaps[-3:]] if mid else [],
        "steps_over_3x_median": sum(g > 3 * mid for g in gaps),
    }


def shape_steps(args) -> None:
    """Parts 2 and 3 on a real model's shape with random weights (a GPU, typically)."""
    from benchmarks import random_checkpoint
    from benchmarks.gpu_bench.run import device_name
    from benchmarks.gpu_bench.step_timing import free_memory
    from cluster.config import load_model_config

    started = time.perf_counter()
    path = args.model or random_checkpoint.default_dir(args.shape, args.bits)
    report: dict = {
        "machine": {**machine(), "gpu": device_name()},
        "args": vars(args) | {"model": str(path)},
        "checkpoint": random_checkpoint.write_checkpoint(path, args.shape, args.bits, 64, 0),
    }
    free_memory()
    print(f"checkpoint {path}: {report['checkpoint']}", flush=True)
    prompt = random_checkpoint.bench_prompt(load_model_config(path).text.vocab_size, 64)
    if args.oracle_rates:
        report["oracle"] = asyncio.run(
            oracle_table(
                path, prompt, args.oracle_rates, args.rounds, args.max_tokens, args.oracle_variants
            )
        )
    else:
        runner = bare_runner(path)
        report.update(steps_and_keep(runner, prompt, args.step_iters))
    report["seconds"] = time.perf_counter() - started
    print(f"\n{report['seconds']:.0f} s")
    write_json(args.json, report)


# ---- the run ----


def _oracle_variants(text: str) -> tuple[str, ...]:
    variants = tuple(dict.fromkeys(v.strip() for v in text.split(",")))
    known = {"off", "auto", WAITING, AHEAD, *(str(d) for d in range(AUTO_MAX_DEPTH + 1))}
    unknown = [v for v in variants if v not in known]
    if unknown or "off" not in variants:
        raise argparse.ArgumentTypeError(
            f"variants among {', '.join(sorted(known))}, off included; got {text!r}"
        )
    return variants


def _modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(m.strip() for m in text.split(",")))
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"takes {', '.join(MODES)} (comma-separated)")
    return modes


def print_summary(mode: str, summary: dict) -> None:
    print(
        f"\n{mode}: variant  tok/s  (cpu)   over off wall [iqr]     cpu   tokens/step  acceptance"
    )
    for variant, row in summary.items():
        ratio, lo, hi = row["decode_tps_over_off"]
        acc = f"{row['acceptance']:.1%}" if row["acceptance"] is not None else "-"
        print(
            f"{variant:>7} {row['decode_tps']:6.1f} ({row['cpu_tps']:5.1f})  {ratio:5.2f}x "
            f"[{lo:.2f}-{hi:.2f}]  {row['cpu_tps_over_off'][0]:5.2f}x  "
            f"{row['tokens_per_step']:5.2f}  {acc}  drafts/step {row['drafts_per_step']}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("mtp_depth_bench", __doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--step-iters", type=int, default=30)
    parser.add_argument(
        "--sampling",
        type=_modes,
        default=["greedy"],
        help="greedy, sampled (temperature 0.7) or greedy,sampled [greedy]",
    )
    parser.add_argument("--no-mlx-lm", action="store_true", help="leave mlx-lm out")
    parser.add_argument(
        "--shape",
        default=None,
        help="a real model's shape with random weights (benchmarks.random_checkpoint's, e.g. "
        "qwen3_5_27b): parts 2 and 3 only, acceptance needs trained weights",
    )
    parser.add_argument("--bits", type=int, default=4, help="with --shape; 16: bf16")
    parser.add_argument(
        "--oracle-rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=None,
        help="part 4 only: tokens/s of off, depths 1-3 and auto with each draft accepted at "
        "these fixed rates, e.g. 0,0.3,0.5,0.7,0.9 (with --model or --shape)",
    )
    parser.add_argument(
        "--oracle-variants",
        type=_oracle_variants,
        default=ORACLE_VARIANTS,
        help=f"with --oracle-rates: which to run, off among them [{','.join(ORACLE_VARIANTS)}]; "
        f"also 0-4, {WAITING} (depth 1, each step waiting for its verdict) and {AHEAD} (built "
        "ahead of it)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.shape:
        shape_steps(args)
        return
    model_dir = args.model or default_model()
    tokenizer = load_tokenizer(model_dir)
    prompts = [encode(tokenizer, p) for p in CODE_PROMPTS]
    report: dict = {"machine": machine(), "args": vars(args) | {"model": str(model_dir)}}
    if args.oracle_rates:
        report["oracle"] = asyncio.run(
            oracle_table(
                model_dir,
                prompts[0],
                args.oracle_rates,
                args.rounds,
                args.max_tokens,
                args.oracle_variants,
            )
        )
        write_json(args.json, report)
        return
    lm = None
    variants = tuple(v for v in VARIANTS if v != MLX_LM or not args.no_mlx_lm)
    if not args.no_mlx_lm:
        from mlx_lm import load

        lm = load(str(model_dir))
        lm[1].eos_token_ids = set()  # decode exactly --max-tokens, as the engine does

    runs = asyncio.run(measure_runs(model_dir, prompts, args, lm, variants))
    by_mode = {mode: summarize_runs(runs, mode) for mode in args.sampling}
    report["runs"] = [asdict(r) for r in runs]
    report["by_mode"] = by_mode
    for mode, summary in by_mode.items():
        print_summary(mode, summary)
    summary = by_mode[args.sampling[0]]
    rates = summary["4"]["conditional_rates"]
    print("conditional acceptance by draft position (depth 4):", [f"{r:.2f}" for r in rates])

    runner = bare_runner(model_dir)
    report.update(steps_and_keep(runner, prompts[0], args.step_iters, lm and lm[0]))
    step_2 = report["step_by_positions"]["step"][2]["over_1"]
    for mode, rows in by_mode.items():
        predicted = (1 + (rows["1"]["acceptance"] or 0.0)) / step_2
        measured = rows["1"]["decode_tps_over_off"][0]
        report.setdefault("depth1_predicted_over_off", {})[mode] = predicted
        print(f"depth 1 over off, {mode}: predicted {predicted:.2f}x, measured {measured:.2f}x")
    prediction = predict_bandwidth_bound(rates)
    report["prediction_bandwidth_bound"] = prediction
    print(
        f"\nPREDICTION (bandwidth-bound step, MTP link = "
        f"{prediction['mtp_link_over_step']:.3f} step at the 27B 4-bit shape):"
    )
    for k, speedup in prediction["speedup_by_depth"].items():
        print(f"  depth {k}: {speedup:.2f}x over no MTP")
    report["seconds"] = time.perf_counter() - started
    print(f"\n{report['seconds']:.0f} s")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
