"""The dashboard's charts of the last 15 minutes, in headless Chromium: after some requests
and a few samples, each chart draws its series from /api/history; and a model without an MTP
head says so in the header.

The samples are taken by the test on the server's loop (the coordinator's timer is not
running here), 2 s apart on a clock of the test's own, so that what the page draws does not
depend on timing (the requests' own latencies are real, and only checked to be there).
Needs Playwright's Python package and Debian's `chromium`, as tests/test_dashboard.py does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from cluster.model.loading import NO_MTP_HEAD
from coordinator.admission import AdmissionController
from coordinator.api import Monitoring, ServedModel, create_app
from coordinator.history import History, RequestRecorder
from tests.fakes import MODEL_ID, FakeClusterView, FakeEngine, ServedApp, tokenizer

playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")

from tests.test_dashboard import CHROMIUM, CHROMIUM_ARGS, POLL_DEADLINE_MS  # noqa: E402

SCREENSHOT = "/tmp/dashboard_history.png"
CHARTS = ["tokens", "ttft", "tpot", "step", "busy", "acceptance"]


class Clock:
    """The samples' clock, moved by `Dashboard.sample()`; as a wall clock, in 2023."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now


class Dashboard:
    """The coordinator app around a fake engine and view, its history, and a page on it."""

    def __init__(
        self, page: Any, app: ServedApp, view: FakeClusterView, history: History, clock: Clock
    ):
        self.page, self.app, self.view, self.history = page, app, view, history
        self.clock = clock

    def complete(self, prompt: str, max_tokens: int = 6) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        request = urllib.request.Request(
            f"{self.app.url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def sample(self) -> None:
        """One tick of the sampler 2 s after the last, on the server's loop (where the
        recorder is bumped)."""
        self.clock.now += 2.0

        async def tick() -> None:
            self.history.sample()

        self.app.call(tick())

    def node_work(self, busy_s: float, batches: int) -> None:
        """Every node's cumulative counters move on to these."""
        self.view.nodes = [
            replace(n, busy_seconds_total=busy_s * (1 + i / 4), batches_total=batches)
            for i, n in enumerate(self.view.nodes)
        ]


def _dashboard(mtp_head: bool) -> Iterator[Dashboard]:
    if not shutil.which(CHROMIUM):
        (pytest.fail if os.environ.get("CI") else pytest.skip)("apt-get install -y chromium")
    view = FakeClusterView()
    clock = Clock()
    recorder = RequestRecorder()  # the requests' latencies on the real clock
    history = History(view, recorder, interval_s=2.0, clock=clock, wall=clock.wall)
    engine = FakeEngine(reply=lambda _request: (5, 6, 7, 8, 9, 10, 11, 12), chunk_size=2)
    app = create_app(
        engine,
        tokenizer(),
        view,
        served=ServedModel(MODEL_ID, mtp_head=mtp_head),
        admission=AdmissionController(4, 8, 10.0),
        monitoring=Monitoring(view.counters, history=history),
    )
    served = ServedApp(app)
    served.start()
    try:
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
                yield Dashboard(page, served, view, history, clock)
                assert errors == [], f"the page logged errors: {errors}"
            finally:
                browser.close()
    finally:
        served.stop()


@pytest.fixture
def dashboard() -> Iterator[Dashboard]:
    yield from _dashboard(mtp_head=True)


@pytest.fixture
def headless_dashboard() -> Iterator[Dashboard]:
    yield from _dashboard(mtp_head=False)


def test_the_page_draws_the_history_after_some_requests(dashboard: Dashboard):
    expect = playwright.expect
    dashboard.node_work(busy_s=1.0, batches=100)
    dashboard.sample()  # the nodes' first counters: their baseline
    for prompt in ("one", "two", "three"):
        dashboard.complete(prompt)
    dashboard.node_work(busy_s=1.5, batches=200)
    dashboard.sample()  # the requests' interval
    dashboard.complete("four")
    dashboard.node_work(busy_s=2.25, batches=300)
    dashboard.sample()

    document = dashboard.history.as_json()
    assert len(document["t"]) == 3
    assert document["tokens_per_s"] == [0.0, 9.0, 3.0]  # 3 requests of 6 tokens, then 1
    assert document["ttft_ms"]["p50"][0] is None and document["ttft_ms"]["p50"][1] > 0
    assert document["nodes"][0]["step_ms"] == [None, pytest.approx(5.0), pytest.approx(7.5)]
    assert document["nodes"][0]["busy_share"] == [None, 0.25, 0.375]

    page = dashboard.page
    page.goto(f"{dashboard.app.url}/")  # opened after the fact: the history is already there
    charts = page.locator("figure.chart")
    expect(charts).to_have_count(len(CHARTS), timeout=POLL_DEADLINE_MS)
    assert [charts.nth(i).get_attribute("data-chart") for i in range(len(CHARTS))] == CHARTS
    for name in CHARTS:
        chart = page.locator(f'figure.chart[data-chart="{name}"]')
        # every chart has data: a line (two samples or more in a row) or a lone point
        assert chart.locator("polyline.series, circle.series").count() >= 1, name
        expect(chart.locator(".tick").first).to_be_visible()  # its axis is labelled
        expect(chart.locator("text", has_text="now")).to_have_count(1)
    step = page.locator('figure.chart[data-chart="step"]')
    assert step.locator("polyline.series").count() == 3  # one line per node, two samples each
    expect(step.locator(".chart-legend")).to_contain_text("mac-0 7.50")  # the latest
    expect(page.locator('figure.chart[data-chart="busy"] .chart-legend')).to_contain_text("38%")
    expect(page.locator('figure.chart[data-chart="ttft"] .chart-legend')).to_contain_text("p99")
    expect(page.locator("#history-span")).to_contain_text("one sample every 2 s")
    expect(page.locator("#model-note")).to_be_hidden()  # the model has its MTP head

    dashboard.complete("five")
    dashboard.sample()  # a later sample shows up on the next poll
    expect(page.locator('figure.chart[data-chart="tokens"] polyline.series')).to_have_attribute(
        "points", _points(4), timeout=POLL_DEADLINE_MS
    )
    page.screenshot(path=SCREENSHOT, full_page=True)


def test_a_model_without_an_mtp_head_says_so_in_the_header(headless_dashboard: Dashboard):
    expect = playwright.expect
    page = headless_dashboard.page
    page.goto(f"{headless_dashboard.app.url}/")
    expect(page.locator("#model-note")).to_have_text(NO_MTP_HEAD, timeout=POLL_DEADLINE_MS)
    expect(page.locator("#model-note")).to_be_visible()
    expect(page.locator("figure.chart")).to_have_count(len(CHARTS))  # with no samples yet
    expect(page.locator("#history-span")).to_have_text("no samples yet")


def _points(count: int) -> Any:
    """A polyline's `points` attribute with `count` points."""
    return re.compile(r"^\S+(?: \S+){" + str(count - 1) + "}$")
