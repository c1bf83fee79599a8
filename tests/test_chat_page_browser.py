"""The chat page in a real browser (headless Chromium driven by Selenium) against a real server with the default
model: the model list loads, a message streams a reply with its stats, Stop ends a reply mid-way and the server
aborts that request; with a vision-language model (a tiny random-weight Idefics3) an attached image goes with the
message. Skipped where Chromium, chromedriver or selenium are missing (.ci/run installs them).

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
    time.sleep(0.5)  # /model_info answered: a text-only model gets no attach button
    assert not browser.find_element(By.ID, "attach").is_displayed()

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


def test_attach_an_image_for_a_vision_model(browser, tmp_path_factory):
    """The attach button shows for a vision model; a file picked goes as a data: URL image_url part with the text,
    its thumbnail stays in the conversation, and the reply is what the server gives that message."""
    pytest.importorskip("transformers")
    import httpx
    from selenium.webdriver.common.by import By
    from tiny_vlm import build_tiny_idefics3, image

    from petrel import LLM

    vlm = build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny-idefics3-page")))
    picture = tmp_path_factory.mktemp("images") / "cat.png"
    image(150, 100, 0).save(picture)
    llm = LLM(vlm.path, kv_cache_memory=1 << 24)
    try:
        with BackgroundServer(build_app(llm, "tiny-vlm")) as srv:
            browser.get(srv.url + "/")
            browser.execute_script("localStorage.clear()")
            browser.get(srv.url + "/")
            attach = _wait(lambda: browser.find_element(By.ID, "attach").is_displayed(), 30, "the attach button")
            assert attach
            _set(browser, "temperature", "0")
            _set(browser, "max-tokens", "6")
            browser.find_element(By.ID, "image-file").send_keys(str(picture))
            _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#attachments img"), 10, "the thumbnail")
            _set(browser, "input", "What is this?")
            browser.find_element(By.ID, "send").click()
            _wait(lambda: "tokens" in _last_reply(browser)[1], 120, "the reply")
            text, stats = _last_reply(browser)
            assert "HTTP" not in text and "6 tokens" in stats
            user = browser.find_elements(By.CSS_SELECTOR, ".msg.user")[-1]
            assert user.find_elements(By.CSS_SELECTOR, ".images img")  # the image stays in the conversation
            assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img")  # and left the composer
            # the page sent what this request sends: the same reply
            with open(picture, "rb") as f:
                import base64

                url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
            want = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()
            assert text == want["choices"][0]["message"]["content"]
    finally:
        llm.shutdown()
