"""`petal api`'s chat page in headless Chromium (Debian's chromium + chromedriver, driven by selenium).

Run by scripts/test-browser, which starts a loopback swarm (node1 serving blocks 0..15 of SmolLM2-135M-Instruct,
node2 and node2b both 15..30) and `petal api` in front of it, and passes the page's address in $PETAL_PAGE_URL,
the 15..30 nodes as `name=pid@host:port` (their metrics address) in $PETAL_REPLICAS, and where to save screenshots
in $PETAL_SCREENSHOTS. Every wait is bounded.
"""

import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import wait
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

URL = os.environ.get("PETAL_PAGE_URL")
SHOTS = Path(os.environ.get("PETAL_SCREENSHOTS", "target/browser"))
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = "What is the capital of France?"
# Through a 2-node swarm on 2 cores SmolLM2 answers this in about a second; the bound is for slow CI machines.
ANSWER_TIMEOUT = 120


def set_field(driver, element_id, value):
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)
    # The page saves settings on change.
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def last_answer(driver):
    answers = driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")
    return answers[-1] if answers else None


def ask(driver, text):
    prompt = wait(driver, 10, lambda d: (lambda p: p if p.is_enabled() else None)(d.find_element(By.ID, "prompt")),
                  "the prompt box is not enabled")
    before = len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant"))
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)
    wait(driver, 10, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) > before,
         "no answer bubble appeared after Enter")
    return last_answer(driver)


def test_question_streams_an_answer_with_its_route(browser):
    if not URL:
        pytest.fail("PETAL_PAGE_URL is not set: run scripts/test-browser")
    browser.get(URL)
    wait(browser, 30, lambda d: d.find_element(By.ID, "model").text == MODEL_NAME,
         "the page did not show the model's name (GET /v1/models)")
    assert "swarm" in browser.find_element(By.ID, "status-text").text
    # Greedy, as `petal generate` and the API tests: the answer is known.
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "64")
    set_field(browser, "system", "")

    answer = ask(browser, QUESTION)
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    # The reply arrives in pieces: record what the bubble shows while the answer is still streaming.
    seen = set()

    def finished(_):
        if "streaming" in (answer.get_attribute("class") or ""):
            seen.add(content.text)
        return answer.get_attribute("data-state")

    state = wait(browser, ANSWER_TIMEOUT, finished, f"no finished answer within {ANSWER_TIMEOUT} s")
    text = content.text
    meta = answer.find_element(By.CSS_SELECTOR, ".meta")
    assert state == "done", f"state {state!r}: {meta.text}"
    assert "Paris" in text, text
    # Partial texts seen during streaming are prefixes of the answer.
    assert all(text.startswith(s.rstrip("…")) for s in seen if s), (seen, text)

    route = meta.find_element(By.CSS_SELECTOR, ".route")
    hops = [h.text for h in route.find_elements(By.CSS_SELECTOR, ".hop")]
    assert len(hops) == 2, hops
    assert hops[0].startswith("node1(") and "0..15" in hops[0], hops
    assert hops[1].startswith("node2") and "15..30" in hops[1], hops  # node2 or its replica node2b
    assert "tokens/s" in meta.text, meta.text
    # The question and the answer are in the conversation, in order.
    users = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.user .content")
    assert [u.text for u in users] == [QUESTION]

    SHOTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SHOTS / "chat-page.png"))


def test_stop_button_ends_a_long_answer(browser):
    set_field(browser, "max-tokens", "400")
    answer = ask(browser, "Write a long story about a dragon who learns to cook.")
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    wait(browser, ANSWER_TIMEOUT, lambda d: len(content.text) > 20, "the long answer did not start streaming")
    stop = browser.find_element(By.ID, "stop")
    assert stop.is_displayed()
    started = time.monotonic()
    stop.click()
    state = wait(browser, 30, lambda d: answer.get_attribute("data-state"), "Stop did not end the answer")
    assert state == "stopped", state
    assert time.monotonic() - started < 10
    assert "stopped" in answer.find_element(By.CSS_SELECTOR, ".meta").text
    # The page is ready for the next question: Send is back, Stop is gone.
    assert browser.find_element(By.ID, "send").is_displayed()
    assert not stop.is_displayed()
    assert browser.save_screenshot(str(SHOTS / "chat-page-stopped.png"))


def replicas():
    """{name: (pid, metrics address)} of the nodes serving 15..30."""
    found = {}
    for item in filter(None, os.environ.get("PETAL_REPLICAS", "").split(",")):
        name, rest = item.split("=", 1)
        pid, addr = rest.split("@", 1)
        found[name] = (int(pid), addr)
    if len(found) != 2:
        pytest.fail(f"PETAL_REPLICAS must name the two 15..30 nodes, got {found}")
    return found


def steps_served(addr):
    """The node's `petal_steps_total`: inference steps it has run."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("petal_steps_total "):
                return float(line.split()[1])
    return 0.0


def test_failover_is_shown_under_the_answer(browser):
    """Kill the 15..30 node serving an answer mid-stream: the answer goes on through the replica, and the line under
    it shows the failover and the new route."""
    nodes = replicas()
    set_field(browser, "max-tokens", "300")
    answer = ask(browser, "Write a long story about a knight who befriends a dragon.")
    content = answer.find_element(By.CSS_SELECTOR, ".content")
    wait(browser, ANSWER_TIMEOUT, lambda d: len(content.text) > 20, "the long answer did not start streaming")
    # The 15..30 node running this answer: the one whose step count grows while it streams (nothing else runs: the
    # API runs with --verify off, so no output check runs steps on the other replica).
    base = {n: steps_served(addr) for n, (_, addr) in nodes.items()}
    serving = wait(browser, 30, lambda d: [n for n, (_, addr) in nodes.items() if steps_served(addr) >= base[n] + 2],
                   "no 15..30 node is running the answer")
    assert len(serving) == 1, serving
    victim = serving[0]
    survivor = next(n for n in nodes if n != victim)
    assert answer.get_attribute("data-state") is None, "the answer ended before a node could be killed"
    before = len(content.text)
    os.kill(nodes[victim][0], signal.SIGKILL)
    state = wait(browser, ANSWER_TIMEOUT, lambda d: answer.get_attribute("data-state"),
                 f"the answer did not finish after {victim} was killed")
    meta = answer.find_element(By.CSS_SELECTOR, ".meta")
    assert state == "done", f"state {state!r}: {meta.text}"
    assert len(content.text) > before, "nothing came after the failover"
    failovers = [e.text for e in meta.find_elements(By.CSS_SELECTOR, ".event.failover")]
    assert len(failovers) == 1 and "15..30" in failovers[0], failovers
    hops = [h.text for h in meta.find_elements(By.CSS_SELECTOR, ".route .hop")]
    assert len(hops) == 2 and hops[1].startswith(survivor + "("), (hops, survivor)
    browser.execute_script("arguments[0].scrollIntoView({block: 'end'})", meta)
    assert browser.save_screenshot(str(SHOTS / "chat-page-failover.png"))
