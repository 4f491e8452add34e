"""The chat page at ``/`` in a real headless browser (Debian's chromium + chromedriver, driven by
selenium): it lists the model, streams a reply, and its Stop button cancels the request. Skips,
naming what is missing, when no browser is installed (.ci/run installs one)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_helpers import MODEL, Server, wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.skip(f"no headless browser: {missing} not found (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,800"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as exc:  # e.g. a snap shim in place of the browser
        pytest.skip(f"the headless browser {CHROMIUM} did not start: {exc.msg}")
    yield driver
    driver.quit()


def test_chat_page_streams_and_stop_cancels(browser: webdriver.Chrome, server: Server, tmp_path: Path):
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 30, poll_frequency=0.02)  # fast polls: Stop must land mid-stream
    wait.until(lambda d: [o.text for o in Select(d.find_element(By.ID, "model")).options] == [MODEL])
    browser.find_element(By.ID, "system").send_keys("You are terse.")
    thinking = browser.find_element(By.ID, "thinking")
    if thinking.is_selected():
        thinking.click()  # thinking off: the reply streams as content
    limit = browser.find_element(By.ID, "max-tokens")
    limit.clear()
    limit.send_keys("250")  # prompt + 250 fit max_len 320
    before = server.handle.stats()
    browser.find_element(By.ID, "prompt").send_keys("Hello there")
    browser.find_element(By.ID, "send").click()

    def streamed_text(d: webdriver.Chrome) -> str:
        replies = d.find_elements(By.CSS_SELECTOR, ".msg.assistant:not(.reasoning)")
        return replies[-1].text if replies else ""

    wait.until(lambda d: len(streamed_text(d)) > 0 and "tok/s" in d.find_element(By.ID, "stats").text)
    first = streamed_text(browser)
    wait.until(lambda d: len(streamed_text(d)) > len(first))  # still streaming: more text arrived
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Hello there"
    browser.save_screenshot(str(tmp_path / "chat_streaming.png"))
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda d: "stopped" in d.find_element(By.ID, "stats").text)
    wait_for(lambda: server.handle.stats().cancelled == before.cancelled + 1, what="the stop to cancel the request")
    assert server.handle.stats().completed == before.completed
    assert browser.find_element(By.ID, "send").is_enabled()
    browser.save_screenshot(str(tmp_path / "chat_stopped.png"))
    assert (tmp_path / "chat_streaming.png").stat().st_size > 0
