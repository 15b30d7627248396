"""MTP deeper than one draft: greedy identity at depths 1..4 with rejections at every
position, every cache (the MTP head's included) equal to a run that never saw a draft, in one
process and over three nodes (one step message per hop at any depth); lossless sampling at
depth 3 and under `auto`; requests of different depths in one batch; the adaptive depth policy."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections import Counter
from pathlib import Path
from unittest import mock

import mlx.core as mx
import nodes
import numpy as np
import pytest
from checkpoints import make_checkpoint
from conftest import CODE_PROMPTS, run
from forced_rejections import ForcedRejections
from nodes import NodeGroup, node_infos, remote_engine
from scipy.stats import chisquare
from test_rollback import _assert_same_caches
from test_sampling import _homogeneity_pvalue

from cluster.decode import verify
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import LocalEngine, open_local_engine
from cluster.decode.mtp_depth import (
    CLOSE_PROBE_EVERY,
    PROBE_EVERY,
    PROBE_STEPS,
    REPRODUCIBLE_DEPTH,
    SWITCH_MARGIN,
    Acceptance,
    DepthPolicy,
    choose_depth,
    depth_rates,
    served_depth,
)
from cluster.decode.sampling import RequestRandom
from cluster.decode.step_cost import RoundClock, StepCost
from cluster.decode.tail import Tail
from cluster.messages import (
    RequestError,
    RequestOptions,
    SamplingParams,
    StepRequest,
    parse_mtp_depth,
)
from cluster.model.shard import even_ranges

node_factory = nodes.node_factory  # the fixture, for this module

MAX_TOKENS = 24
DEPTHS = (1, 2, 3, 4)
MOE_PROMPTS = ((5, 17, 300, 42, 7), (1, 2, 3, 4, 5, 6, 7, 8, 9))


class _Model:
    """A model, its prompts and the greedy output of a run without MTP (the oracle)."""

    def __init__(self, path: Path, prompts: list[tuple[int, ...]]):
        self.path = path
        self.prompts = prompts
        self.oracle: dict[str, tuple[int, ...]] = {}
        self.local: LocalEngine | None = None
        self.clean: ForcedRejections | None = None

    def requests(self, depth: int | str, mtp: bool = True) -> list[GenerationRequest]:
        options = RequestOptions(mtp=mtp, mtp_depth=depth)
        return [
            GenerationRequest(p, MAX_TOKENS, options, request_id=f"p{i}")
            for i, p in enumerate(self.prompts)
        ]


def _open(path: Path, prompts: list[tuple[int, ...]]) -> _Model:
    model = _Model(path, prompts)

    async def go() -> None:
        plain = await open_local_engine(path, mtp=False)
        try:
            for request in model.requests(0, mtp=False):
                out = await plain.engine.generate(request)
                assert out.drafted == 0 and len(out.tokens) == MAX_TOKENS
                model.oracle[request.request_id] = request.prompt + out.tokens
        finally:
            plain.close()
        model.local = await open_local_engine(path)
        # The run that never sees a draft: MTP on (its cache is fed) at depth 0; state kept.
        model.clean = ForcedRejections(model.local.engine.pipeline, {}, keep_state=True)
        engine = GenerationEngine(model.clean)
        for request in model.requests(0):
            assert (await engine.generate(request)).drafted == 0

    run(go())
    return model


@pytest.fixture(scope="module")
def bundled(model_dir, tokenizer):
    model = _open(model_dir, [tuple(tokenizer.encode(p)) for p in CODE_PROMPTS[:2]])
    yield model
    model.local.close()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("moe"), moe=True)
    model = _open(path, list(MOE_PROMPTS))
    yield model
    model.local.close()


def _assert_forced_everywhere(forced: Counter, depth: int) -> None:
    """A rejection at every draft position of a k-draft step, and steps with none."""
    assert all(forced[(depth, at)] > 0 for at in range(1, depth + 2)), forced


@pytest.mark.parametrize("concurrent", [False, True], ids=["alone", "concurrent"])
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("which", ["bundled", "moe"])
def test_greedy_identity_and_caches_in_one_process(
    which: str, depth: int, concurrent: bool, request
) -> None:
    """Concurrent: the requests decode in one batch and reject at different positions, so each
    step's recurrent states are merged from the batch's and its snapshots' rows
    (`cluster.model.cache.stack_rows`); tokens and caches still match the runs alone."""
    model: _Model = request.getfixturevalue(which)
    local = model.local
    forced = ForcedRejections(
        local.engine.pipeline, model.oracle, keep_state=True, stagger=concurrent
    )

    async def go():
        engine = GenerationEngine(forced)
        if concurrent:
            return await asyncio.gather(*(engine.generate(r) for r in model.requests(depth)))
        return [await engine.generate(r) for r in model.requests(depth)]

    outputs = run(go())
    for request_, out in zip(model.requests(depth), outputs, strict=True):
        assert request_.prompt + out.tokens == model.oracle[request_.request_id]
    _assert_forced_everywhere(forced.forced, depth)
    clean_ids = {rid.split(".")[0]: rid for rid in model.clean.held}

    def compare() -> None:  # on the MLX thread, which owns the arrays
        forced.settle(local.runners)
        for run_id in forced.held:
            clean_id = clean_ids[run_id.split(".")[0]]
            for runner in local.runners:
                ours, theirs = runner.requests[run_id], runner.requests[clean_id]
                _assert_same_caches(ours.cache, theirs.cache)
                if ours.tail is not None:
                    _assert_same_caches(ours.tail.mtp_cache, theirs.tail.mtp_cache)

    try:
        local.worker.call(compare)
    finally:
        for run_id in forced.held:
            run(local.engine.pipeline.release(run_id))


@pytest.fixture(scope="module")
def trio(node_factory) -> NodeGroup:
    return node_factory(3)


@pytest.mark.parametrize("which", ["bundled", "moe"])
def test_greedy_identity_over_three_nodes(which: str, trio, request) -> None:
    """Every depth with forced rejections; one step message per hop per step at any depth."""
    model: _Model = request.getfixturevalue(which)
    layers = 8 if which == "bundled" else 4

    async def go():
        ranges = even_ranges(layers, 3)
        async with remote_engine(model.path, trio.addresses, ranges=ranges) as (_, pipeline):
            for depth in DEPTHS:
                forced = ForcedRejections(pipeline, model.oracle)
                engine = GenerationEngine(forced)
                before = [i.steps_total for i in await node_infos(trio.addresses)]
                sent_before = pipeline.messages_sent
                chunks: list = []
                for r in model.requests(depth):
                    out = await engine.generate(r, chunks.append)
                    assert r.prompt + out.tokens == model.oracle[r.request_id], depth
                after = [i.steps_total for i in await node_infos(trio.addresses)]
                sent = pipeline.messages_sent - sent_before
                # One prefill message per request, then one per decode step (= per chunk after
                # the first); every node received exactly those.
                assert sent == len(chunks), depth
                assert [b - a for a, b in zip(before, after, strict=True)] == [sent] * 3
                _assert_forced_everywhere(forced.forced, depth)

    run(go())


def test_requests_of_different_depths_share_a_batch(bundled) -> None:
    local = bundled.local
    depths: list[int | str] = [0, 1, 2, 3, 4, "auto"]
    runner = local.runners[0]
    batches: list[set[int]] = []
    real_run = runner.run

    def spy(steps, hidden=None):
        batches.append({s.draft_len for s in steps})
        return real_run(steps, hidden)

    runner.run = spy
    try:
        requests = [bundled.requests(depth)[i % 2] for i, depth in enumerate(depths)]

        async def go():
            return await asyncio.gather(*(local.engine.generate(r) for r in requests))

        outputs = run(go())
    finally:
        del runner.run
    for r, out in zip(requests, outputs, strict=True):
        assert r.prompt + out.tokens == bundled.oracle[r.request_id]
    assert max(len(b) for b in batches) >= 3, batches  # drafts of several depths, one batch
    assert all(not runner.requests.keys() - set(bundled.clean.held) for runner in local.runners)


SAMPLED_DRAWS = 200  # per run; the verifier's own test below has the statistical power
SHORT_PROMPT = "def "


# What `auto` reads as a batch's cost in the sampling test: a step of n positions costs
# 1 + n / AUTO_ROWS_PER_STEP. A draft then pays while its acceptance beats about a row's
# share of the step (about half in the test's batch of several hundred positions): `auto`
# drafts deep after passing drafts, shallower or not at all after rejected ones, and more as
# the batch thins out; its depth follows each request's verdicts (in a run: 753 steps, 220 at
# depth 0, 733 drafts). On the machine's own timings, whether it drafts at all would be a
# matter of the test machine's load.
AUTO_ROWS_PER_STEP = 500


def _linear_cost() -> StepCost:
    cost = StepCost()
    for _ in range(3):  # trusted: TRUSTED_SAMPLES samples of each count
        for positions in (1, 2):
            cost.record(positions, 1.0 + positions / AUTO_ROWS_PER_STEP, context=16)
    return cost


async def _sampled_tokens(
    model_dir: Path, prompt: tuple[int, ...], depth: int | str, seed0: int
) -> tuple[list[list[int]], Tail | None]:
    """Tokens 1..3 of SAMPLED_DRAWS seeded draws of 5 tokens at `depth` (0: MTP off), all
    at once, and the tail (its depth counters)."""
    mtp = depth != 0
    local = await open_local_engine(model_dir, mtp=mtp)
    tail = local.runners[-1].tail
    if depth == "auto":
        tail.round_cost = _linear_cost()  # what `auto` weighs drafts against (the runner
        # still records the real timings into its own)
    try:
        requests = [
            GenerationRequest(
                prompt,
                5,
                RequestOptions(SamplingParams(1.0, seed=seed0 + i), mtp=mtp, mtp_depth=depth),
            )
            for i in range(SAMPLED_DRAWS)
        ]
        outs = await asyncio.gather(*(local.engine.generate(r) for r in requests))
        if isinstance(depth, int) and depth:
            assert sum(o.drafted for o in outs) >= SAMPLED_DRAWS * depth  # deep steps ran
        return [[o.tokens[i] for o in outs] for i in (1, 2, 3)], tail if mtp else None
    finally:
        local.close()


@pytest.fixture(scope="module")
def plain_draws(model_dir, tokenizer) -> list[list[int]]:
    """Tokens 1..3 of the draws without MTP: the reference of every depth's."""
    return run(_sampled_tokens(model_dir, tuple(tokenizer.encode(SHORT_PROMPT)), 0, 0))[0]


@pytest.mark.parametrize("depth", [3, "auto"])
def test_sampling_is_distributed_as_without_mtp(model_dir, tokenizer, plain_draws, depth) -> None:
    """At depth 3, tokens 1..3 come from one step [y, d1, d2, d3] of the chained head; under
    `auto`, from steps whose depth it chose from the verdicts before them (deep, shallow or
    none). Either way each is distributed as without MTP."""
    prompt = tuple(tokenizer.encode(SHORT_PROMPT))
    spec, tail = run(_sampled_tokens(model_dir, prompt, depth, 10**6))
    for a, b in zip(plain_draws, spec, strict=True):
        assert _homogeneity_pvalue(a, b) > 1e-3
    if depth == "auto":  # it did choose: steps without drafts, and drafts deeper than one
        steps, plain, drafts = tail.depth_steps, tail.depth_plain_steps, tail.depth_drafts
        assert 0 < plain < steps and drafts > steps - plain, (steps, plain, drafts)


def _verify_three(p: np.ndarray, q: np.ndarray, trials: int, accept_all: bool) -> list[Counter]:
    """Draft three tokens from q[i], verify against p[i] (p[3]: the bonus); count the token
    emitted at each position among the trials that reached it."""
    params, rng = SamplingParams(1.0), RequestRandom(7)
    target, draft = mx.log(mx.array(p)), mx.log(mx.array(q))
    counts = [Counter() for _ in range(3)]
    for _ in range(trials):
        drafts = tuple(mx.random.categorical(draft, key=rng.next_key()).tolist())
        c = verify.propose(target, drafts, draft, params, rng)
        if accept_all:
            c = verify.Candidates(c.target, mx.ones_like(c.accept), c.correction)
        mx.eval(c.arrays())
        emitted, _ = verify.decide(c, drafts)
        for i, token in enumerate(emitted[:3]):
            counts[i][token] += 1
    return counts


def _fits(counts: Counter, p: np.ndarray) -> float:
    observed = np.array([counts[t] for t in range(len(p))])
    return float(chisquare(observed, p * observed.sum()).pvalue)


def test_verification_of_three_drafts_is_lossless_and_the_test_has_power() -> None:
    """The sequential rule: whatever position a step reaches, its token is distributed as the
    target's there; accepting every draft instead is caught by the same test."""
    p = np.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25],
                  [0.4, 0.3, 0.2, 0.1]])  # fmt: skip
    q = np.array([[0.1, 0.6, 0.1, 0.2], [0.2, 0.2, 0.5, 0.1], [0.7, 0.1, 0.1, 0.1]])
    counts = _verify_three(p, q, 3000, accept_all=False)
    assert all(_fits(counts[i], p[i]) > 1e-3 for i in range(3)), counts
    assert min(sum(c.values()) for c in counts) > 500  # every position was reached often
    biased = _verify_three(p, q, 3000, accept_all=True)
    assert _fits(biased[0], p[0]) < 1e-3


def test_sampled_drafts_must_be_the_tails(bundled) -> None:
    local = bundled.local
    runner = local.runners[0]
    prompt = bundled.prompts[0]
    options = RequestOptions(SamplingParams(1.0, seed=3), mtp_depth=2)

    def go():
        (first,) = runner.run([StepRequest("s", prompt, 0, options=options)]).results
        assert len(first.drafts) == 2
        y, (d1, d2) = first.tokens[0], first.drafts
        out = runner.run([StepRequest("s", (y, d1, (d2 + 1) % 8192), len(prompt), draft_len=2)])
        assert "not the tail's" in str(out.errors["s"])
        runner.release("s")

    local.worker.call(go)


# ---- the adaptive policy ----


def _cost(per_row: float, base: float = 1.0) -> StepCost:
    cost = StepCost()
    for positions in (1, 2, 4, 8):
        cost.record(positions, base + per_row * (positions - 1))
    return cost


def test_auto_drafts_deep_where_rows_are_cheap_and_not_where_they_cost() -> None:
    high = Acceptance()
    for _ in range(50):
        high.record(4, 4)
    # A GPU, rows nearly free; a CPU, every row costs.
    assert choose_depth(depth_rates(high, _cost(per_row=0.02), 0), 0) == 4
    low = Acceptance()
    for _ in range(50):
        low.record(2, 0)
    assert choose_depth(depth_rates(low, _cost(per_row=1.0), 0), 0) == 0
    # A long batch: the request's rows cost per row even where a lone step's rows are free.
    assert choose_depth(depth_rates(high, _cost(1.0), 30), 30) < choose_depth(
        depth_rates(high, _cost(0.02), 0), 0
    )


def test_acceptance_counts_only_judged_positions() -> None:
    acceptance = Acceptance()
    acceptance.record(3, 1)  # d1 passed, d2 failed, d3 never judged
    assert acceptance.judged == [1.0, 1.0, 0.0] and acceptance.passed == [1.0, 0.0, 0.0]
    # d3, never judged, is taken to pass as often as d2 does, no more.
    assert acceptance.rate(0) > acceptance.rate(2) == acceptance.rate(1)


def test_fixed_depths_stay_fixed_and_auto_explores() -> None:
    """`auto` probes one deeper for PROBE_STEPS steps every PROBE_EVERY steps."""
    assert DepthPolicy(3).next_depth(_cost(1.0), 0) == 3
    auto = DepthPolicy("auto")
    for _ in range(50):
        auto.record(1, 0)
    chosen = [auto.next_depth(_cost(1.0), 0) for _ in range(PROBE_EVERY + PROBE_STEPS)]
    assert chosen.count(0) == PROBE_EVERY and chosen.count(1) == PROBE_STEPS


def _depth_changes(margin: float) -> int:
    """How often `auto` changes its depth outside probes over 300 steps whose first draft
    passes every other time (and so does the second, when judged), on a device where depths
    1 and 2 are then worth the same (1.5 / 1.2 against 1.75 / 1.4 plain steps' time), both
    better than a plain step: the running estimates swing around 0.5 with each verdict."""
    cost = StepCost()
    for _ in range(3):
        for positions, seconds in ((1, 1.0), (2, 1.2), (3, 1.4), (4, 1.9), (5, 2.4)):
            cost.record(positions, seconds)
    auto, changes, last, verdicts = DepthPolicy("auto"), 0, None, 0
    with mock.patch("cluster.decode.mtp_depth.SWITCH_MARGIN", margin):
        for _ in range(300):
            probes = auto.probes
            depth = auto.next_depth(cost, 0)
            if auto.probes == probes:  # a decision on the estimates, not a probe
                changes += last is not None and depth != last
                last = depth
            accepted = 0
            while accepted < depth:
                verdicts += 1
                if verdicts % 2:
                    break
                accepted += 1
            auto.record(depth, accepted)
    return changes


def test_auto_keeps_its_depth_where_depths_are_close() -> None:
    """A change of depth costs a step that cannot be built ahead; where the estimates cannot
    tell two depths apart `auto` stays, and changes only for one clearly faster."""
    assert _depth_changes(margin=0.0) >= 5
    assert _depth_changes(margin=SWITCH_MARGIN) <= 2


def _drafting_after_early_rejections(close_every: int) -> list[int]:
    """The depths of 48 steps of a request whose first two drafts fail and every later one
    passes, on a CPU-like curve (a second row costs 0.6 of a step, a draft at 0.6 pays)."""
    cost = StepCost()
    for _ in range(3):
        for positions, seconds in ((1, 1.0), (2, 1.6), (3, 2.2)):
            cost.record(positions, seconds)
    auto, failed, depths = DepthPolicy("auto"), 0, []
    with mock.patch("cluster.decode.mtp_depth.CLOSE_PROBE_EVERY", close_every):
        for _ in range(48):
            depth = auto.next_depth(cost, 0)
            if depth:
                passed = depth if failed >= 2 else 0
                failed += depth - passed
                auto.record(depth, passed)
            depths.append(depth)
    return depths


def test_a_request_plain_after_a_few_early_rejections_drafts_again_when_drafts_pass() -> None:
    """A few rejections at a text's start leave an estimate on few verdicts near where a
    draft stops paying: `auto` probes soon, and drafts again once the probes pass."""
    depths = _drafting_after_early_rejections(CLOSE_PROBE_EVERY)
    assert 0 in depths[:8] and all(depths[-16:]), depths
    # Probing only every PROBE_EVERY steps, it would stay plain for the rest of the answer.
    assert not any(_drafting_after_early_rejections(PROBE_EVERY)[-16:])


def test_a_seeded_sampled_request_gets_a_fixed_depth_where_auto_is_only_the_default() -> None:
    """Sampled tokens follow the drafts and `auto`'s drafts follow the machine's timings, so a
    request that asks for repeatable tokens (a seed) is served at a fixed depth."""
    seeded, unseeded = SamplingParams(0.7, seed=5), SamplingParams(0.7)
    assert served_depth("auto", seeded) == REPRODUCIBLE_DEPTH
    assert served_depth("auto", unseeded) == "auto"
    assert served_depth("auto", SamplingParams(seed=5)) == "auto"  # greedy: tokens never vary
    assert served_depth(3, seeded) == 3  # a server's fixed depth stays


def test_a_new_request_starts_from_the_nodes_acceptance() -> None:
    node = Acceptance()
    for _ in range(50):
        DepthPolicy("auto", node).record(2, 0)  # every request's verdicts reach the node's
    assert node.judged[0] > 5  # (at most 1 / (1 - DECAY) with the decay)
    assert DepthPolicy("auto", node).next_depth(_cost(1.0), 0) == 0
    assert DepthPolicy("auto").next_depth(_cost(0.02), 0) == 4  # optimistic, rows nearly free


def test_a_round_is_timed_between_steady_batches_of_the_same_requests_and_shape() -> None:
    clock = RoundClock(StepCost())
    clock.batch(("a",), 2, 100, now=10.0)
    clock.batch(("a",), 2, 101, now=10.5)  # a's round at 2 positions: 0.5 s
    clock.batch(("b",), 1, 50, now=10.6)  # another group in between: its own rounds
    clock.batch(("a",), 3, 102, now=11.2)  # a changed shape: no round of 3 yet
    clock.batch(("a",), None, 0, now=11.3)  # not steady (a prefill chunk joined, say)
    clock.batch(("a",), 3, 104, now=11.9)  # after an unsteady batch: nothing to time from
    clock.batch(("a",), 3, 105, now=12.6)
    clock.batch(("a", "b"), 4, 105, now=13.0)  # a batch of other requests: nothing yet
    assert clock.cost.curve() == {11: {2: (pytest.approx(0.5), 1), 3: (pytest.approx(0.7), 1)}}
    assert clock.cost.seconds(3, 2000) == pytest.approx(0.7)  # short contexts share a curve


def test_step_cost_interpolates_and_extrapolates() -> None:
    cost = StepCost()
    assert cost.seconds(3) is None
    cost.record(2, 2.0)
    assert cost.seconds(1) is None and cost.seconds(5) is None  # one point: nothing else known
    cost.record(4, 4.0)
    assert cost.seconds(3) == 3.0 and cost.seconds(6) == 6.0 and cost.seconds(1) == 1.0
    with pytest.raises(ValueError):
        cost.record(0, 1.0)


def test_mtp_depth_option_is_validated() -> None:
    assert parse_mtp_depth("auto") == "auto" and parse_mtp_depth("3") == 3
    for bad in ("-1", "9", "deep", ""):
        with pytest.raises(RequestError, match="mtp_depth"):
            parse_mtp_depth(bad)
    with pytest.raises(RequestError):
        RequestOptions(mtp_depth=True)


# ---- the option on the command line and in the HTTP API ----


def test_generate_takes_mtp_depth(model_dir) -> None:
    from click.testing import CliRunner

    from cluster.cli import main

    args = ["generate", "--prompt", CODE_PROMPTS[0], "--max-tokens", "12", "--json"]
    outs = {depth: CliRunner().invoke(main, [*args, "--mtp-depth", depth]) for depth in ("0", "3")}
    assert all(out.exit_code == 0 for out in outs.values()), outs
    plain, deep = (json.loads(outs[d].output) for d in ("0", "3"))
    assert plain["tokens"] == deep["tokens"] and plain["drafted"] == 0 < deep["drafted"]
    bad = CliRunner().invoke(main, [*args, "--mtp-depth", "9"])
    assert bad.exit_code != 0 and "mtp_depth" in bad.output


def test_http_requests_name_their_depth_or_get_the_servers() -> None:
    from fakes import MODEL_ID, FakeClusterView, FakeEngine, ServedApp, tokenizer

    from coordinator.admission import AdmissionController
    from coordinator.api import Monitoring, ServedModel, create_app

    engine, view = FakeEngine.saying("x = 1"), FakeClusterView()
    app = create_app(
        engine, tokenizer(), view, served=ServedModel(MODEL_ID, "auto"),
        admission=AdmissionController(2, 2, 5.0), monitoring=Monitoring(view.counters),
    )  # fmt: skip
    served = ServedApp(app)
    served.start()
    try:

        def post(body: dict) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
            try:
                body = {"prompt": "def f(", "max_tokens": 4, **body}
                conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})  # fmt: skip
                response = conn.getresponse()
                response.read()
                return response.status
            finally:
                conn.close()

        assert post({"mtp_depth": 3}) == 200 and engine.requests[-1].options.mtp_depth == 3
        assert post({}) == 200 and engine.requests[-1].options.mtp_depth == "auto"
        assert post({"mtp_depth": 0}) == 200 and engine.requests[-1].options.mtp_depth == 0
        assert post({"mtp_depth": "deep"}) == 400 and post({"mtp_depth": 9}) == 400
        assert len(engine.requests) == 3
    finally:
        served.stop()


def test_sampled_deep_drafts_over_three_nodes_match_one_process(trio, bundled) -> None:
    """Seeded sampling at depth 3: the same tokens across nodes as in one process (the drafts
    and their distributions stay on the tail; only token ids travel)."""
    options = RequestOptions(SamplingParams(0.8, seed=11), mtp_depth=3)
    request = GenerationRequest(bundled.prompts[0], MAX_TOKENS, options)

    async def remote():
        ranges = even_ranges(8, 3)
        async with remote_engine(bundled.path, trio.addresses, ranges=ranges) as (engine, _):
            return await engine.generate(request)

    async def local():
        return await bundled.local.engine.generate(request)

    there, here = run(remote()), run(local())
    assert there.tokens == here.tokens and there.drafted == here.drafted > MAX_TOKENS // 2
