"""The dashboard at `/` in headless Chromium: every node shown in pipeline order, and a node
that goes down is marked as such on the next poll.

Needs Playwright's Python package (`pip install playwright`, no browser download) and Debian's
`chromium`; the test is skipped, saying why, when either is missing.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from tests.fakes import FakeClusterView, FakeEngine, Served, serve

playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = "/tmp/dashboard.png"
POLL_DEADLINE_MS = 5000  # the page polls every second; allow a few polls


@pytest.fixture
def page_and_server() -> Iterator[tuple[Any, Served]]:
    if not shutil.which(CHROMIUM):
        # CI installs it (.ci/run): there a missing browser is a failure, not a skip.
        (pytest.fail if os.environ.get("CI") else pytest.skip)("apt-get install -y chromium")
    with (
        serve(FakeEngine.saying("hi"), view=FakeClusterView()) as served,
        playwright.sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
            page.goto(f"{served.url}/")
            yield page, served
            assert errors == [], f"the page logged errors: {errors}"
        finally:
            browser.close()


def test_dashboard_shows_nodes_and_marks_a_down_one(page_and_server: tuple[Any, Served]):
    page, served = page_and_server
    expect = playwright.expect
    cards = page.locator(".node")
    expect(cards).to_have_count(3, timeout=POLL_DEADLINE_MS)
    for index, node in enumerate(served.view.nodes):
        card = cards.nth(index)  # pipeline order, head first
        expect(card).to_have_attribute("data-node-id", node.node_id)
        expect(card).to_contain_text(node.address)
        expect(card).to_contain_text(f"[{node.shard.start}, {node.shard.end})")
        expect(card).to_contain_text(f"{node.step_latency_ms:.1f} ms")
        phases = node.step_phases_ms
        expect(card).to_contain_text(f"layers {phases['layers']:.2f} · handoff 0.20 · decode 0.10")
        expect(card.locator(".badge")).to_have_text("UP")
        expect(card).not_to_have_class(re.compile(r"\bnode-down\b"))
    expect(cards.nth(0)).to_contain_text("head")
    expect(cards.nth(2)).to_contain_text("tail")
    expect(page.locator("#health")).to_have_text("healthy")
    expect(page.locator("#stat-tps")).to_have_text("42.5")
    expect(page.locator("#stat-acceptance")).to_have_text("73.0%")
    expect(page.locator(".layer")).to_have_count(8)

    served.view.set_up("mac-1", False)
    down = page.locator('.node[data-node-id="mac-1"]')
    expect(down).to_have_class(re.compile(r"\bnode-down\b"), timeout=POLL_DEADLINE_MS)
    expect(down.locator(".badge")).to_have_text("DOWN")
    expect(page.locator(".node-down")).to_have_count(1)
    expect(page.locator("#health")).to_contain_text("degraded")
    assert page.locator(".badge").all_inner_texts() == ["UP", "DOWN", "UP"]
    page.screenshot(path=SCREENSHOT, full_page=True)

    served.view.set_up("mac-1", True)  # and it recovers on the page too
    expect(page.locator(".node-down")).to_have_count(0, timeout=POLL_DEADLINE_MS)


def test_dashboard_says_which_nodes_keep_their_mac_awake(page_and_server: tuple[Any, Served]):
    """Each card says whether its node holds its Mac awake, or why not; a placed node that
    reports no hop yet says its hop is being measured."""
    page, served = page_and_server
    expect = playwright.expect
    note = "not macOS (linux): nothing to keep awake"
    served.view.nodes = [
        replace(n, keeps_awake=True, keep_awake_note="held by /usr/bin/caffeinate -i -s -w 7")
        if i < 2
        else replace(n, keep_awake_note=note)
        for i, n in enumerate(served.view.nodes)
    ]
    cards = page.locator(".node")
    expect(cards).to_have_count(3, timeout=POLL_DEADLINE_MS)
    for i in range(2):
        expect(cards.nth(i).locator("dd.awake")).to_have_text("yes", timeout=POLL_DEADLINE_MS)
        expect(cards.nth(i)).to_contain_text("measuring")  # no hop reported yet
    expect(cards.nth(2).locator("dd.asleep")).to_have_text(f"no · {note}")
    expect(cards.nth(2)).not_to_contain_text("measuring")  # the tail has no hop


def test_dashboard_shows_the_caches_of_the_running_requests(page_and_server: tuple[Any, Served]):
    """Each card shows how many requests the node holds caches for, their bytes, and the
    bytes per request; a node that holds none shows no such row."""
    page, served = page_and_server
    expect = playwright.expect
    served.view.nodes = [
        replace(n, running_requests=2, request_cache_bytes=4 * 2**20) if i == 0 else n
        for i, n in enumerate(served.view.nodes)
    ]
    cards = page.locator(".node")
    expect(cards).to_have_count(3, timeout=POLL_DEADLINE_MS)
    expect(cards.nth(0)).to_contain_text("2 · 4 MiB · 2 MiB each", timeout=POLL_DEADLINE_MS)
    expect(cards.nth(1)).not_to_contain_text("Request caches")
