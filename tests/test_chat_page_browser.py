"""The chat page in a real browser (headless Chromium driven by Selenium) against a real server with the default
model: the model list loads, a message streams a reply with its stats, Stop ends a reply mid-way and the server
aborts that request. Skipped where Chromium, chromedriver or selenium are missing (.ci/run installs them).

PETREL_SCREENSHOT=docs/chat-page.png python -m pytest tests/test_chat_page_browser.py  # also saves a screenshot
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from petrel.serve import build_app
from petrel.serve.server import BackgroundServer

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"


def _browser_paths() -> tuple[str, str]:
    chrome = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if chrome is None or driver is None:
        pytest.skip("needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    return chrome, driver


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chrome, driver_path = _browser_paths()
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager reach for the network
    options = Options()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page_server(llm):
    with BackgroundServer(build_app(llm)) as srv:
        yield srv


def _wait(condition, timeout: float = 120.0, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _set(browser, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _last_reply(browser) -> tuple[str, str]:
    from selenium.webdriver.common.by import By

    replies = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    if not replies:
        return "", ""
    return (
        replies[-1].find_element(By.CSS_SELECTOR, ".text").text,
        replies[-1].find_element(By.CSS_SELECTOR, ".stats").text,
    )


def test_type_send_stream_and_stop(browser, page_server, llm):
    from selenium.webdriver.common.by import By

    browser.get(page_server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(page_server.url + "/")
    _wait(lambda: MODEL in browser.find_element(By.ID, "model").text, 30, "the model list")

    # type and send: the reply streams in (its text is seen growing) and ends with TTFT and tokens/s
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", "48")
    _set(browser, "input", "What is a petrel? Answer in two sentences.")
    browser.find_element(By.ID, "send").click()
    lengths = set()
    _wait(lambda: lengths.add(len(_last_reply(browser)[0])) or "tokens" in _last_reply(browser)[1], 120, "the reply")
    text, stats = _last_reply(browser)
    assert text.strip() and "TTFT" in stats and "tokens/s" in stats
    assert len({n for n in lengths if n}) >= 2, "the reply did not stream (no intermediate text seen)"
    assert browser.find_element(By.ID, "stop").get_attribute("disabled")
    shot = os.environ.get("PETREL_SCREENSHOT")
    if shot:
        browser.save_screenshot(shot)

    # stop mid-reply: the text stops growing, the page says so, and the server drops the request
    _set(browser, "max-tokens", "1000")
    _set(browser, "input", "Write a very long story about a robot who learns to paint.")
    browser.find_element(By.ID, "send").click()
    _wait(lambda: len(_last_reply(browser)[0]) > 20, 120, "the second reply to start")
    browser.find_element(By.ID, "stop").click()
    _wait(lambda: "stopped" in _last_reply(browser)[1], 10, "the stopped reply")
    assert browser.find_element(By.ID, "status").text == "Stopped."
    stopped = _last_reply(browser)[0]
    time.sleep(1.0)
    assert _last_reply(browser)[0] == stopped
    _wait(lambda: llm.engine.num_unfinished_requests == 0, 10, "the server to abort the request")
    tokens = int(re.search(r"(\d+) tokens(?!/)", _last_reply(browser)[1]).group(1))
    assert 0 < tokens < 1000
