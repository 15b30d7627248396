"""`auto` never loses: it stops drafting where drafts fail (a noise-weight model, in one
process, over node processes and through the coordinator's HTTP API with logprobs and
constrained decoding, output identical to MTP off), backs off within 32 tokens when a
request's acceptance drops, and probes at a bounded rate. Counts and decisions only: speed is
for the benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nodes
import openai
import pytest
from checkpoints import make_noise_copy
from conftest import run
from fakes import MODEL_ID, FakeClusterView, ServedApp, tokenizer
from nodes import NodeGroup, remote_engine

from cluster.decode.engine import GenerationChunk, GenerationEngine, GenerationRequest
from cluster.decode.local_engine import LocalEngine, open_local_engine
from cluster.decode.mtp_depth import PLAIN_PROBE_STEPS, PROBE_EVERY, PROBE_STEPS, DepthPolicy
from cluster.decode.step_cost import StepCost
from cluster.messages import RequestOptions, StepRequest, StepResult
from cluster.model.shard import even_ranges
from coordinator.admission import AdmissionController
from coordinator.api import ServedModel, create_app

node_factory = nodes.node_factory

TOKENS = 200
WARM_UP = 64  # tokens after which `auto` must have settled
PROMPT = tuple(range(100, 140))


class _Steps:
    """A pipeline wrapper that keeps every decode step's draft count, by position."""

    def __init__(self, inner):
        self.inner = inner
        self.drafts: list[tuple[int, int]] = []  # (position, draft_len) of each decode step

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    async def submit(self, step: StepRequest) -> StepResult:
        if step.n_confirmed == 1:
            self.drafts.append((step.position, step.draft_len))
        return await self.inner.submit(step)

    async def release(self, request_id: str) -> None:
        await self.inner.release(request_id)


def _curve(second_row: float) -> StepCost:
    """A node's step costs as `auto` reads them, fixed: a step of n positions costs
    1 + second_row * (n - 1) at every context, measured often enough to be trusted, so that a
    test's decisions do not follow the timings of a busy machine (the runner still records
    its real ones into its own curve)."""
    cost = StepCost()
    for _ in range(5):
        for positions in range(1, 7):
            for context in (16, 64, 100, 256, 1024):
                cost.record(positions, 1.0 + second_row * (positions - 1), context=context)
    return cost


# A CPU, where each row costs about half a step, and a GPU reading its weights once a step,
# where a second row costs a quarter.
COST_CURVES = {"cpu": 0.5, "gpu": 0.25}


def _drafting_share(drafts: list[tuple[int, int]], after: int) -> float:
    late = [k for position, k in drafts if position >= after]
    return sum(1 for k in late if k) / len(late)


@pytest.fixture(scope="module")
def noise_model(tmp_path_factory) -> Path:
    return make_noise_copy(tmp_path_factory.mktemp("noise"))


async def _greedy(pipeline, depth, mtp=True) -> tuple[tuple[int, ...], _Steps, int]:
    steps = _Steps(pipeline)
    request = GenerationRequest(PROMPT, TOKENS, RequestOptions(mtp=mtp, mtp_depth=depth))
    out = await GenerationEngine(steps).generate(request)
    return out.tokens, steps, out.drafted


@pytest.mark.parametrize("device", COST_CURVES)
def test_auto_stops_drafting_where_drafts_fail_in_one_process(noise_model, device) -> None:
    async def go():
        plain = await open_local_engine(noise_model, mtp=False)
        try:
            expected, _, _ = await _greedy(plain.engine.pipeline, 0, mtp=False)
        finally:
            plain.close()
        local = await open_local_engine(noise_model)
        try:
            fixed, _, drafted = await _greedy(local.engine.pipeline, 1)
            assert drafted >= TOKENS - 2  # depth 1 drafts on every step...
            local.runners[-1].tail.round_cost = _curve(COST_CURVES[device])
            auto, steps, _ = await _greedy(local.engine.pipeline, "auto")
        finally:
            local.close()
        assert fixed == auto == expected
        assert _drafting_share(steps.drafts, len(PROMPT) + WARM_UP) < 0.05, steps.drafts

    run(go())


@pytest.fixture(scope="module")
def pair(node_factory) -> NodeGroup:
    return node_factory(2)


def test_auto_stops_drafting_where_drafts_fail_over_nodes(noise_model, pair) -> None:
    """The tail of a remote pipeline holds the same policy: the coordinator's requests back
    off as the local engine's do."""

    async def go():
        local = await open_local_engine(noise_model, mtp=False)
        try:
            expected, _, _ = await _greedy(local.engine.pipeline, 0, mtp=False)
        finally:
            local.close()
        ranges = even_ranges(8, 2)
        async with remote_engine(noise_model, pair.addresses, ranges=ranges) as (_, pipeline):
            auto, steps, _ = await _greedy(pipeline, "auto")
        assert auto == expected
        assert _drafting_share(steps.drafts, len(PROMPT) + WARM_UP) < 0.05, steps.drafts

    run(go())


class _StepsEngine:
    """The local engine on the noise model behind the HTTP app, its decode steps recorded
    (`_Steps`); opened on the server's loop."""

    def __init__(self) -> None:
        self.local: LocalEngine | None = None
        self.steps: _Steps | None = None

    @property
    def max_context(self) -> int:
        return self.local.engine.max_context

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self.local.engine.stream(request)


@contextmanager
def _serve_auto(model: Path) -> Iterator[tuple[ServedApp, _StepsEngine]]:
    """The coordinator's app whose requests that name no depth get `auto`, as the server's
    setting (`--mtp-depth auto`) gives them."""
    engine = _StepsEngine()
    admission = AdmissionController(2, 2, 10.0)
    app = create_app(
        engine, tokenizer(), FakeClusterView(), served=ServedModel(MODEL_ID, "auto"),
        admission=admission,
    )  # fmt: skip
    served = ServedApp(app)
    served.start()
    try:
        engine.local = served.call(open_local_engine(model))
        engine.local.runners[-1].tail.round_cost = _curve(COST_CURVES["cpu"])
        engine.steps = _Steps(engine.local.engine.pipeline)
        engine.local.engine.pipeline = engine.steps
        yield served, engine
    finally:
        served.stop()  # first: a handler may still be releasing its request on the engine
        if engine.local is not None:
            engine.local.close()


# A string the grammar keeps open past max_tokens: every token of the reply is constrained.
LONG_TEXT = {
    "type": "json_schema",
    "json_schema": {
        "name": "text",
        "schema": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 1000}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
HTTP_CASES = {
    "logprobs": {"logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}},
    "json_schema": {"response_format": LONG_TEXT},
}


@pytest.fixture(scope="module")
def served_auto(noise_model) -> Iterator[tuple[ServedApp, _StepsEngine]]:
    with _serve_auto(noise_model) as served:
        yield served


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_auto_stops_drafting_through_the_http_api(served_auto, case: str) -> None:
    """Greedy chat requests through the coordinator's API: MTP off (`mtp: false`) and the
    server's `auto`, with logprobs or a JSON schema (token masks at every step). The same
    reply, logprobs alike; `auto` drafts on under 5 % of the steps after the first 64 tokens,
    and the usage counts the drafts the steps carried."""
    served, engine = served_auto
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = {"max_tokens": TOKENS, "temperature": 0, **HTTP_CASES[case]}
    extra = kwargs.pop("extra_body", {})
    messages = [{"role": "user", "content": "Tell me about the weather."}]

    def ask(**body: Any) -> Any:
        engine.steps.drafts.clear()
        return client.chat.completions.create(
            model=MODEL_ID, messages=messages, extra_body={**extra, **body}, **kwargs
        )

    plain = ask(mtp=False)
    assert not any(k for _, k in engine.steps.drafts)
    auto = ask()  # the server's depth: `auto`
    drafts = list(engine.steps.drafts)
    assert auto.usage.completion_tokens == plain.usage.completion_tokens == TOKENS
    assert auto.choices[0].message.content == plain.choices[0].message.content
    if case == "logprobs":
        ours, theirs = (r.choices[0].logprobs.content for r in (auto, plain))
        assert [e.token for e in ours] == [e.token for e in theirs]
        for a, b in zip(ours, theirs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=0.02)  # bf16 rounding
            assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    details = auto.usage.completion_tokens_details
    drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert drafted == sum(k for _, k in drafts) > 0  # MTP ran: `auto` probed, at least
    if case == "json_schema":
        assert auto.choices[0].message.content.startswith('{"text":"')
    start = auto.usage.prompt_tokens + WARM_UP
    assert _drafting_share(drafts, start) < 0.05, drafts


@pytest.mark.parametrize("device", COST_CURVES)
def test_auto_backs_off_within_32_tokens_of_an_acceptance_drop(noise_model, device) -> None:
    """A forced verdict: every draft passes for the first 100 tokens, none after."""
    drop = len(PROMPT) + 100

    def verdict(step: StepRequest) -> int:
        return step.draft_len if step.position < drop else 0

    async def go():
        local = await open_local_engine(noise_model)
        local.runners[-1].tail.force_verdict = verdict
        local.runners[-1].tail.round_cost = _curve(COST_CURVES[device])
        try:
            _, steps, _ = await _greedy(local.engine.pipeline, "auto")
        finally:
            local.close()
        return steps.drafts

    drafts = run(go())
    before = [k for position, k in drafts if len(PROMPT) + 20 <= position < drop]
    # It drafted while they passed, but for the plain steps of at most one periodic probe.
    assert sum(1 for k in before if k) >= len(before) - PLAIN_PROBE_STEPS, drafts
    settled = [(p, k) for p, k in drafts if drop + 32 <= p < drop + 32 + PROBE_EVERY - 1]
    # At most one probe run in a probe period after the back-off.
    assert sum(1 for _, k in settled if k) <= PROBE_STEPS, drafts


# ---- the policy on its own: the decay arithmetic and the probe bound ----


@pytest.mark.parametrize("second_row", COST_CURVES.values(), ids=COST_CURVES)
def test_the_estimate_falls_within_32_steps_of_a_drop(second_row: float) -> None:
    """100 passing drafts then none: each failing step emits one token, so steps = tokens;
    one verdict read a step late (a step built ahead)."""
    cost = _curve(second_row)
    policy = DepthPolicy("auto")
    depth, late = 0, None
    for _ in range(120):  # every draft passes
        depth = policy.next_depth(cost, 0, 100)
        if late is not None:
            policy.record(late, late)
        late = depth
    assert depth >= 1
    steps = 0
    while depth and steps < 64:
        depth = policy.next_depth(cost, 0, 100)
        policy.record(late, 0)
        late = depth
        steps += 1
    assert depth == 0 and steps <= 32, steps


# A CPU's second row, and a busy machine's reading of one at the floor of its price (a plain
# round timed in a slow moment): a draft that never passes must not look worth drafting there.
@pytest.mark.parametrize("second_row", [0.5, 0.0], ids=["cpu", "read-as-free"])
def test_probes_where_drafts_fail_stay_within_two_percent(second_row: float) -> None:
    cost = _curve(second_row)
    policy = DepthPolicy("auto")
    chosen = []
    for _ in range(1000):
        depth = policy.next_depth(cost, 0, 100)
        policy.record(depth, 0)
        chosen.append(depth)
    late = chosen[WARM_UP:]
    assert sum(1 for k in late if k) <= 0.02 * len(late) + PROBE_STEPS, chosen
    assert max(late) == 1  # a probe drafts once, one deeper than 0


def test_a_probe_that_passes_goes_on() -> None:
    """Drafting pays again after a long plain run: the probe's passing drafts extend it
    until the estimate says to draft."""
    cost = _curve(0.25)
    policy = DepthPolicy("auto")
    for _ in range(300):
        policy.record(policy.next_depth(cost, 0, 100), 0)
    chosen = []
    for _ in range(PROBE_EVERY + 40):
        depth = policy.next_depth(cost, 0, 100)
        policy.record(depth, depth)
        chosen.append(depth)
    assert all(chosen[-8:]), chosen


def test_step_cost_follows_the_context() -> None:
    cost = StepCost()
    for _ in range(3):
        cost.record(1, 1.0, context=100)
        cost.record(2, 1.5, context=100)
        cost.record(1, 4.0, context=5000)  # attention dominates: a plain step costs 4x
    assert cost.seconds(2, 100) == 1.5
    # Bucket 5000 never ran 2 positions: the nearest bucket's shape, at this bucket's level.
    assert cost.seconds(2, 5000) == pytest.approx(6.0)
    assert cost.seconds(1, 7000) == 4.0  # the same power-of-two bucket
    assert cost.seconds(2, 3) == pytest.approx(1.5)  # no curve there: the nearest one's
