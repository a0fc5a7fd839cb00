"""`petal monitor`'s page in headless Chromium: a 3-node swarm's coverage, then a killed node's blocks turning red.

Run by scripts/test-browser, which starts a loopback swarm with a 4 s record TTL (node1 serving blocks 0..10 of
SmolLM2-135M-Instruct, node2 10..20, node3 20..30) and `petal monitor --refresh 1` on it, and passes the page's
address in $PETAL_MONITOR_URL, node2's pid in $PETAL_MONITOR_VICTIM and where to save screenshots in
$PETAL_SCREENSHOTS. Every wait is bounded.
"""

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest
from conftest import wait

URL = os.environ.get("PETAL_MONITOR_URL")
SHOTS = Path(os.environ.get("PETAL_SCREENSHOTS", "target/browser"))
NUM_BLOCKS = 30
RED = (214, 39, 40)

# The page redraws itself every 2 s, replacing its elements: read everything in one script, never through element
# handles that a redraw makes stale.
SNAPSHOT = """
const section = document.querySelector('section.model');
if (!section) return null;
const blocks = [...section.querySelectorAll('.coverage .block')];
const list = section.querySelector('.uncovered-list');
return {
  replicas: blocks.map(b => Number(b.dataset.replicas)),
  uncoveredClass: blocks.map(b => b.classList.contains('uncovered')),
  colors: blocks.map(b => getComputedStyle(b).backgroundColor),
  rows: [...section.querySelectorAll('tr.server')].map(r => ({
    name: r.dataset.name, blocks: r.dataset.blocks,
    cells: [...r.querySelectorAll('td')].map(td => td.textContent)})),
  summary: section.querySelector('.summary').textContent,
  uncovered: list ? list.dataset.uncovered : '',
};
"""


def snapshot(driver):
    return driver.execute_script(SNAPSHOT)


def rgb(css_color):
    """(r, g, b) of a computed `rgb(...)` or `rgba(...)` colour."""
    inside = css_color[css_color.index("(") + 1:css_color.index(")")]
    return tuple(int(float(part)) for part in inside.split(",")[:3])


def rows(snap):
    return [(r["name"], r["blocks"]) for r in snap["rows"]]


def test_coverage_shows_the_swarm_and_a_killed_nodes_blocks_turn_uncovered(browser):
    if not URL:
        pytest.fail("PETAL_MONITOR_URL is not set: run scripts/test-browser")
    victim = int(os.environ.get("PETAL_MONITOR_VICTIM", "0"))
    if not victim:
        pytest.fail("PETAL_MONITOR_VICTIM (node2's pid) is not set: run scripts/test-browser")
    browser.get(URL)

    def all_covered(driver):
        snap = snapshot(driver)
        return snap if snap and snap["replicas"] == [1] * NUM_BLOCKS and len(snap["rows"]) == 3 else None

    snap = wait(browser, 60, all_covered, "the page never showed the three nodes covering all 30 blocks once")
    assert rows(snap) == [("node1", "0..10"), ("node2", "10..20"), ("node3", "20..30")], snap
    assert "30 blocks, 3 servers" in snap["summary"] and "every block served" in snap["summary"], snap
    assert not any(snap["uncoveredClass"]) and all(rgb(c) != RED for c in snap["colors"]), snap
    # Each server row says its throughput, load, free cache, reachability and version.
    cells = snap["rows"][0]["cells"]
    assert float(cells[4]) > 0, cells
    assert cells[5] == "0" and "/" in cells[6] and cells[7] and cells[9], cells
    # The JSON behind the page says the same.
    with urllib.request.urlopen(URL.rstrip("/") + "/api/v1/state", timeout=5) as r:
        state = json.load(r)
    assert len(state["models"]) == 1 and state["models"][0]["replicas"] == [1] * NUM_BLOCKS, state
    SHOTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SHOTS / "monitor-page.png"))

    os.kill(victim, signal.SIGKILL)
    expected = [1] * 10 + [0] * 10 + [1] * 10

    def gap_shown(driver):
        snap = snapshot(driver)
        return snap if snap and snap["replicas"] == expected else None

    snap = wait(browser, 30, gap_shown, "node2's blocks 10..20 never turned uncovered after it was killed")
    assert snap["uncoveredClass"] == [r == 0 for r in expected], snap
    assert [rgb(c) == RED for c in snap["colors"]] == [r == 0 for r in expected], snap["colors"]
    assert snap["uncovered"] == "10..20", snap
    assert rows(snap) == [("node1", "0..10"), ("node3", "20..30")], snap
    assert browser.save_screenshot(str(SHOTS / "monitor-page-uncovered.png"))
