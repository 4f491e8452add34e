"""The chat page at ``/`` in a real headless browser (Debian's chromium + chromedriver, driven by
selenium): it lists the model, streams a reply, and its Stop button cancels the request; replies
render as sanitized Markdown with highlighted code; settings and conversations survive a reload;
regenerate, edit and copy work; a failed turn shows a human message and is not sent back; nothing
overflows sideways at desktop or phone widths (screenshots of both are printed). Skips, naming what
is missing, when no browser is installed (.ci/run installs one).

The tiny model emits random tokens, so rendering is checked on known Markdown put through the page's
own path (a conversation in localStorage, rendered on load), and the streaming path with the real
server. Request bodies are read from a ``fetch`` wrapper the test installs in the page."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlx_serving import Serving, text_embedding
from mlx_serving.models.text_embedding import write_embedding_checkpoint
from mlx_serving.server import ServedModel, create_app
from server_helpers import MODEL, Server, serve, wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

PYTHON = "def greet(name):\n    return f\"hello {name}\"  # a comment\n"
MARKDOWN = f"""# Title

Some **bold** text, `inline code` and a [link](https://example.com).

```python
{PYTHON}```

| col a | col b |
| --- | --- |
| 1 | 2 |

- one
- two

<img src=x onerror="window.__xss = 'img'"> <script>window.__xss = 'script'</script>
<svg onload="window.__xss = 'svg'"></svg> [bad](javascript:window.__xss='link')
"""
LONG_TOKEN = "x" * 500
WIDE_CODE = "```\n" + "wide_code_line_" * 60 + "\n```"
WIDE_TABLE = ("| " + " | ".join(f"column{i}" for i in range(40)) + " |\n|" + "---|" * 40 + "\n| "
              + " | ".join("v" * 12 for _ in range(40)) + " |")
# Installed in the page: records each chat request body in window.__requests; window.__next, when
# set, answers the next call itself: "network" rejects as fetch does offline, "loading" answers the
# 503 the server gives while it loads its model (with Retry-After: 1), an array of objects streams
# them as SSE events (CRLF-separated, split mid-event), then [DONE].
FETCH_SPY = r"""
window.__requests = [];
window.__next = null;
const realFetch = window.fetch;
window.fetch = function (url, options) {
  if (!String(url).includes("chat/completions")) return realFetch.apply(this, arguments);
  window.__requests.push(JSON.parse(options.body));
  const fail = window.__next;
  window.__next = null;
  if (fail === "network") return Promise.reject(new TypeError("Failed to fetch"));
  if (fail === "loading") return Promise.resolve(new Response(JSON.stringify({error: {
      message: "the server is loading: no model is ready yet", type: "server_error", param: null, code: "loading"}}),
      {status: 503, headers: {"Content-Type": "application/json", "Retry-After": "1"}}));
  if (Array.isArray(fail)) {
    const text = fail.map((e) => "data: " + JSON.stringify(e) + "\r\n\r\n").join("") + "data: [DONE]\r\n\r\n";
    const bytes = new TextEncoder().encode(text), cut = Math.floor(bytes.length / 2);
    const body = new ReadableStream({
      start(c) { c.enqueue(bytes.slice(0, cut)); c.enqueue(bytes.slice(cut)); c.close(); }});
    return Promise.resolve(new Response(body, {status: 200, headers: {"Content-Type": "text/event-stream"}}));
  }
  return realFetch.apply(this, arguments);
};
"""


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


def _wait(driver: webdriver.Chrome, timeout: float = 30) -> WebDriverWait:
    return WebDriverWait(driver, timeout, poll_frequency=0.02)


def _open(driver: webdriver.Chrome, server: Server, settings: dict | None = None, chats: list | None = None) -> None:
    """A fresh page: localStorage cleared (then seeded with ``settings`` / ``chats``), the model listed,
    the fetch spy installed."""
    driver.get(server.url + "/")
    driver.execute_script("localStorage.clear();")
    if settings is not None:
        driver.execute_script("localStorage.setItem('mlx-serving-settings', arguments[0]);", json.dumps(settings))
    if chats is not None:
        driver.execute_script("localStorage.setItem('mlx-serving-conversations', arguments[0]);"
                              "localStorage.setItem('mlx-serving-current', arguments[1]);",
                              json.dumps(chats), json.dumps(chats[0]["id"]))
    _reload(driver)


def _reload(driver: webdriver.Chrome) -> None:
    driver.refresh()
    _wait(driver).until(lambda d: [o.text for o in Select(d.find_element(By.ID, "model")).options] == [MODEL])
    driver.execute_script(FETCH_SPY)


def _chat(*messages: tuple[str, str], id: str = "c1") -> dict:
    return {"id": id, "created": 1, "updated": 1, "messages": [{"role": r, "content": c} for r, c in messages]}


def _replies(driver: webdriver.Chrome) -> list:
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def _idle(driver: webdriver.Chrome) -> None:
    _wait(driver).until(lambda d: d.find_element(By.ID, "send").is_enabled())


def _send(driver: webdriver.Chrome, text: str) -> None:
    """Type ``text``, send it, wait for the reply to end."""
    sent = len(_requests(driver))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
    _wait(driver).until(lambda d: len(_requests(d)) > sent)
    _idle(driver)


def _requests(driver: webdriver.Chrome) -> list[dict]:
    return driver.execute_script("return window.__requests")


def _open_settings(driver: webdriver.Chrome) -> None:
    if driver.find_element(By.ID, "settings").get_attribute("hidden") is not None:
        driver.find_element(By.ID, "toggle-settings").click()


def _type(driver: webdriver.Chrome, id: str, text: str) -> None:
    field = driver.find_element(By.ID, id)
    field.clear()
    field.send_keys(text)


QUICK = {"thinking": False, "max_tokens": "4"}  # short replies, streamed as content


def test_chat_page_streams_and_stop_cancels(browser: webdriver.Chrome, server: Server, tmp_path: Path):
    _open(browser, server)
    wait = _wait(browser)  # fast polls: Stop must land mid-stream
    _open_settings(browser)
    browser.find_element(By.ID, "system").send_keys("You are terse.")
    thinking = browser.find_element(By.ID, "thinking")
    if thinking.is_selected():
        thinking.click()  # thinking off: the reply streams as content
    _type(browser, "max-tokens", "250")  # prompt + 250 fit max_len 320
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
    # the partial reply is kept (marked stopped) and goes back to the model with the next message
    assert "stopped" in browser.find_element(By.CSS_SELECTOR, ".turn.assistant .meta").text
    (body,) = _requests(browser)
    assert body["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Hello there"}]
    assert body["max_tokens"] == 250 and body["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_model_picker_lists_generation_models_only(browser: webdriver.Chrome, tiny_serving: Serving,
                                                        tmp_path: Path):
    """An embedding model served beside a generation model is not offered for chat."""
    ckpt = write_embedding_checkpoint(tmp_path / "e", quantized=False, dtype="float32")
    with text_embedding.from_mlx4bit(ckpt, max_len=64) as emb_serving, Serving.start(tiny_serving) as gen, \
            Serving.start(emb_serving) as emb:
        app = create_app({MODEL: gen, "emb": ServedModel(emb, 64, None, task="embed")})
        with serve(app) as url:
            assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} == {MODEL, "emb"}
            browser.get(url + "/")
            browser.execute_script("localStorage.clear();")
            _reload(browser)  # waits until the options are exactly [MODEL]


def test_vendored_assets_are_served_and_nothing_else(server: Server):
    for name, kind in (("marked.umd.js", "text/javascript"), ("purify.min.js", "text/javascript"),
                       ("highlight.min.js", "text/javascript"), ("highlight-github.min.css", "text/css")):
        response = httpx.get(f"{server.url}/static/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind), name
        assert len(response.content) > 1000
    for path in ("/static/../_app.py", "/static/..%2F_app.py", "/static/%2e%2e%2f_app.py", "/static/_app.py",
                 "/static/README.md", "/static/marked.LICENSE.md", "/static/vendor/marked.umd.js", "/static/",
                 "/static/index.html", "/static/..%5c_app.py"):
        response = httpx.get(server.url + path)
        assert response.status_code == 404, path
        assert "def " not in response.text and "<html" not in response.text.lower(), path


def test_markdown_renders_highlighted_and_sanitized(browser: webdriver.Chrome, server: Server):
    _open(browser, server, chats=[_chat(("user", "show me"), ("assistant", MARKDOWN))])
    (reply,) = _replies(browser)
    assert reply.find_element(By.TAG_NAME, "h1").text == "Title"
    assert reply.find_element(By.TAG_NAME, "strong").text == "bold"
    link = reply.find_element(By.CSS_SELECTOR, "a[href='https://example.com']")
    assert link.get_attribute("rel") == "noopener noreferrer nofollow" and link.get_attribute("target") == "_blank"
    code = reply.find_element(By.CSS_SELECTOR, ".code-block pre code.hljs.language-python")
    assert code.find_elements(By.CSS_SELECTOR, ".hljs-keyword") and code.find_elements(By.CSS_SELECTOR, ".hljs-comment")
    assert code.get_attribute("textContent") == PYTHON
    assert [c.text for c in reply.find_elements(By.CSS_SELECTOR, ".table-wrap table td")] == ["1", "2"]
    assert [li.text for li in reply.find_elements(By.CSS_SELECTOR, "ul li")] == ["one", "two"]
    # the payload shows as text; nothing of it runs or loads
    time.sleep(0.3)  # an onerror / onload would have fired by now
    assert browser.execute_script("return window.__xss") is None
    html = reply.get_attribute("innerHTML")
    assert not reply.find_elements(By.CSS_SELECTOR, "img, script, svg, [onerror], [onload]")
    assert "javascript:" not in "".join(a.get_attribute("href") or "" for a in reply.find_elements(By.TAG_NAME, "a"))
    assert "&lt;img src=x onerror=" in html and "bad" in reply.text
    link = reply.find_element(By.XPATH, ".//a[text()='bad']")
    link.click()  # a sanitized link goes nowhere
    assert browser.execute_script("return window.__xss") is None
    # DOMPurify itself, on raw HTML (what the page runs after marked): the handlers are gone, and the same
    # HTML unsanitized does run here (the check above can fail)
    assert "onerror" not in browser.execute_script(
        "return mlxChat.sanitize('<img src=x onerror=\"window.__xss=1\"><b>ok</b>')")
    browser.execute_script("const d = document.createElement('div'); d.innerHTML = arguments[0];"
                           "document.body.append(d);",
                           "<img src=x onerror=\"window.__control = 1\">")
    _wait(browser, 5).until(lambda d: d.execute_script("return window.__control") == 1)
    assert browser.execute_script("return window.__xss") is None


def test_copy_buttons_copy_the_message_and_the_code(browser: webdriver.Chrome, server: Server):
    _open(browser, server, chats=[_chat(("user", "show me"), ("assistant", MARKDOWN))])
    try:  # the real clipboard where the browser grants it, else a stand-in that records the text
        browser.execute_cdp_cmd("Browser.grantPermissions", {
            "origin": server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
        real = True
    except WebDriverException:
        real = False
    if not real:
        browser.execute_script("navigator.clipboard.writeText = async (t) => { window.__copied = t; };")

    def clipboard() -> str:
        if not real:
            return browser.execute_script("return window.__copied")
        return browser.execute_async_script(
            "navigator.clipboard.readText().then(arguments[0], (e) => arguments[0]('!' + e));")

    browser.find_element(By.CSS_SELECTOR, ".code-block .copy-code").click()
    _wait(browser, 5).until(lambda d: clipboard() == PYTHON)
    assert browser.find_element(By.CSS_SELECTOR, ".code-block .copy-code").text == "Copied"
    browser.find_element(By.CSS_SELECTOR, ".turn.assistant .actions .copy").click()
    _wait(browser, 5).until(lambda d: clipboard() == MARKDOWN)
    browser.find_element(By.CSS_SELECTOR, ".turn.user .actions .copy").click()
    _wait(browser, 5).until(lambda d: clipboard() == "show me")


def test_reasoning_streams_into_a_collapsible_block(browser: webdriver.Chrome, server: Server):
    # the tiny model does not think: the stream is canned (the page's own SSE parsing and rendering)
    _open(browser, server)
    delta = lambda **d: {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}  # noqa: E731
    browser.execute_script("window.__next = arguments[0]", [
        delta(role="assistant"), delta(reasoning_content="Let me think "), delta(reasoning_content="about it."),
        delta(content="**Because**"), delta(content=" it is."),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}])
    _send(browser, "why?")
    details = browser.find_element(By.CSS_SELECTOR, ".turn.assistant details.reasoning")
    assert details.get_attribute("open") is None and details.find_element(By.TAG_NAME, "summary").text == "Reasoning"
    details.find_element(By.TAG_NAME, "summary").click()
    assert details.find_element(By.CSS_SELECTOR, ".reasoning-text").text == "Let me think about it."
    (reply,) = _replies(browser)
    assert reply.text == "Because it is." and reply.find_element(By.TAG_NAME, "strong").text == "Because"
    assert "4 tokens" in browser.find_element(By.CSS_SELECTOR, ".turn.assistant .meta").text
    assert "finish: stop" in browser.find_element(By.CSS_SELECTOR, ".turn.assistant .meta").text
    _reload(browser)  # kept, and the reasoning is not sent back
    reasoning = browser.find_element(By.CSS_SELECTOR, ".reasoning-text")
    assert reasoning.get_attribute("textContent") == "Let me think about it."
    assert browser.execute_script("return mlxChat.requestBody(mlxChat.current).messages") == [
        {"role": "user", "content": "why?"}, {"role": "assistant", "content": "**Because** it is."}]


def test_settings_persist_and_reach_the_server(browser: webdriver.Chrome, server: Server):
    _open(browser, server)
    _open_settings(browser)
    _type(browser, "system", "Be brief.")
    _type(browser, "temperature", "0.7")
    _type(browser, "top-p", "0.9")
    _type(browser, "top-k", "20")
    _type(browser, "max-tokens", "5")
    browser.find_element(By.ID, "thinking").click()  # on by default: now off
    _reload(browser)
    _open_settings(browser)
    values = {id: browser.find_element(By.ID, id).get_attribute("value")
              for id in ("system", "temperature", "top-p", "top-k", "min-p", "max-tokens")}
    assert values == {"system": "Be brief.", "temperature": "0.7", "top-p": "0.9", "top-k": "20", "min-p": "",
                      "max-tokens": "5"}
    assert not browser.find_element(By.ID, "thinking").is_selected()
    _send(browser, "Hi")
    (body,) = _requests(browser)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (0.7, 0.9, 20, 5)
    assert "min_p" not in body and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["model"] == MODEL and body["stream"] is True
    # the streamed reply went through the Markdown path and carries its stats
    (reply,) = _replies(browser)
    assert reply.get_attribute("innerHTML").strip() and "tokens" in browser.find_element(By.CSS_SELECTOR, ".meta").text
    browser.find_element(By.ID, "reset-settings").click()
    assert browser.find_element(By.ID, "system").get_attribute("value") == ""
    assert browser.find_element(By.ID, "max-tokens").get_attribute("value") == "256"


def test_conversations_persist_switch_and_delete(browser: webdriver.Chrome, server: Server):
    _open(browser, server, settings=QUICK)
    _send(browser, "first chat")
    first_reply = _replies(browser)[0].get_attribute("innerHTML")
    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    _send(browser, "second chat")
    assert [m["content"] for m in _requests(browser)[-1]["messages"]] == ["second chat"]  # a new conversation

    def titles(d: webdriver.Chrome) -> list[str]:
        return [b.text for b in d.find_elements(By.CSS_SELECTOR, "#conversations .open")]

    assert titles(browser) == ["second chat", "first chat"]
    _reload(browser)
    assert titles(browser) == ["second chat", "first chat"]
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "second chat"  # the current one is back
    browser.find_elements(By.CSS_SELECTOR, "#conversations .open")[1].click()
    assert [m.text for m in browser.find_elements(By.CSS_SELECTOR, ".msg.user")] == ["first chat"]
    assert _replies(browser)[0].get_attribute("innerHTML") == first_reply
    assert browser.find_element(By.CSS_SELECTOR, "#conversations li[aria-current=true] .open").text == "first chat"
    delete = browser.find_element(By.CSS_SELECTOR, "#conversations li[aria-current=true] .delete")
    delete.click()  # asks first
    assert titles(browser) == ["second chat", "first chat"] and delete.text == "Delete?"
    delete.click()
    assert titles(browser) == ["second chat"]
    _reload(browser)
    assert titles(browser) == ["second chat"]


def test_regenerate_and_edit_resend(browser: webdriver.Chrome, server: Server):
    _open(browser, server, settings=QUICK)
    _send(browser, "tell me")
    before = server.handle.stats().completed
    browser.find_element(By.CSS_SELECTOR, ".turn.assistant .regenerate").click()
    _wait(browser).until(lambda d: len(_requests(d)) == 2)
    _idle(browser)
    wait_for(lambda: server.handle.stats().completed == before + 1, what="the regenerated reply")
    assert len(_replies(browser)) == 1  # replaced, not added
    assert _requests(browser)[1]["messages"] == [{"role": "user", "content": "tell me"}]
    _send(browser, "and more")
    assert [m["role"] for m in _requests(browser)[2]["messages"]] == ["user", "assistant", "user"]
    # edit the first message: everything after it is replaced by the new exchange
    browser.find_elements(By.CSS_SELECTOR, ".turn.user .edit")[0].click()
    area = browser.find_element(By.CSS_SELECTOR, ".edit-box textarea")
    assert area.get_attribute("value") == "tell me"
    area.clear()
    area.send_keys("tell me again")
    browser.find_element(By.CSS_SELECTOR, ".edit-box .save-edit").click()
    _wait(browser).until(lambda d: len(_requests(d)) == 4)
    _idle(browser)
    assert _requests(browser)[3]["messages"] == [{"role": "user", "content": "tell me again"}]
    assert [m.text for m in browser.find_elements(By.CSS_SELECTOR, ".msg.user")] == ["tell me again"]
    assert len(_replies(browser)) == 1
    stored = browser.execute_script("return JSON.parse(localStorage.getItem('mlx-serving-conversations'))")
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]


def test_failed_turns_are_explained_and_not_sent_back(browser: webdriver.Chrome, server: Server):
    _open(browser, server, settings={**QUICK, "max_tokens": "100000"})  # more than the context: 400
    _send(browser, "hello")
    error = browser.find_element(By.CSS_SELECTOR, ".turn.assistant .error")
    assert "do not fit the model's context: lower Max tokens" in error.text
    assert "Server said: prompt of" in error.text and "exceeds max_len 320" in error.text  # the server's error.message
    assert error.find_element(By.CSS_SELECTOR, ".retry").is_enabled()
    assert not browser.find_elements(By.CSS_SELECTOR, ".regenerate")
    _open_settings(browser)
    _type(browser, "max-tokens", "4")
    _send(browser, "again")
    assert _requests(browser)[-1]["messages"] == [{"role": "user", "content": "hello"},
                                                  {"role": "user", "content": "again"}]
    # the network fails: said so, and the failed reply is not sent with the next message either
    browser.execute_script("window.__next = 'network'")
    _send(browser, "offline")
    assert "Could not reach the server" in browser.find_elements(By.CSS_SELECTOR, ".error")[-1].text
    # Retry replaces the failed reply (the server answers this time)
    browser.find_elements(By.CSS_SELECTOR, ".error .retry")[-1].click()
    _wait(browser).until(lambda d: len(_requests(d)) == 4)
    _idle(browser)
    assert [m["role"] for m in _requests(browser)[-1]["messages"]] == ["user", "user", "assistant", "user"]
    assert len(browser.find_elements(By.CSS_SELECTOR, ".error")) == 1  # only the first, 400 one is left
    # a 503 while the model loads: the page says so and retries after Retry-After
    browser.execute_script("window.__next = 'loading'")
    browser.find_element(By.ID, "prompt").send_keys("are you ready")
    browser.find_element(By.ID, "send").click()
    _wait(browser, 10).until(
        lambda d: "still loading the model" in d.find_element(By.CSS_SELECTOR, ".turn.pending").text)
    _wait(browser).until(lambda d: len(_requests(d)) == 6)
    _idle(browser)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".error")) == 1
    assert not browser.find_elements(By.CSS_SELECTOR, ".notice")
    assert _requests(browser)[5] == _requests(browser)[4]
    # reload: the failed turns are still shown as failed, still left out of the requests
    _reload(browser)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".error")) == 1
    roles = browser.execute_script("return mlxChat.requestBody(mlxChat.current).messages.map((m) => m.role)")
    assert roles == ["user", "user", "assistant", "user", "assistant", "user", "assistant"]


def _overflow(driver: webdriver.Chrome) -> dict:
    return driver.execute_script("""
        const m = document.getElementById('messages'), pre = document.querySelector('.code-block pre');
        const wrap = document.querySelector('.table-wrap');
        return {doc: document.documentElement.scrollWidth, body: document.body.scrollWidth, inner: window.innerWidth,
                messages: m.scrollWidth, messagesClient: m.clientWidth,
                pre: pre.scrollWidth, preClient: pre.clientWidth,
                table: wrap.scrollWidth, tableClient: wrap.clientWidth};""")


@pytest.mark.parametrize("size", [(1200, 800), (390, 844)], ids=["desktop", "phone"])
def test_no_horizontal_overflow(browser: webdriver.Chrome, server: Server, tmp_path: Path, size: tuple[int, int]):
    width, height = size
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})
    try:
        chat = _chat(("user", "a long one: " + LONG_TOKEN),
                     ("assistant", f"Here: {LONG_TOKEN} and `{LONG_TOKEN}`\n\n{WIDE_CODE}\n\n{WIDE_TABLE}\n\n"
                                   f"```python\n{PYTHON}```"))
        chat["messages"][1]["reasoning"] = "thinking " + LONG_TOKEN
        _open(browser, server, chats=[chat, _chat(("user", LONG_TOKEN), id="c2")])
        browser.find_element(By.CSS_SELECTOR, "details.reasoning summary").click()
        sizes = _overflow(browser)
        assert sizes["inner"] == width
        assert sizes["doc"] <= sizes["inner"] and sizes["body"] <= sizes["inner"], sizes
        assert sizes["messages"] <= sizes["messagesClient"], sizes  # the message list does not scroll sideways
        assert sizes["pre"] > sizes["preClient"] and sizes["table"] > sizes["tableClient"], sizes  # they scroll inside
        shot = tmp_path / f"chat_{width}x{height}.png"
        browser.save_screenshot(str(shot))
        print(f"screenshot {width}x{height}: {shot}")
        _open_settings(browser)
        browser.find_element(By.ID, "toggle-sidebar").click()  # phone: opens the list; desktop: hides it
        sizes = _overflow(browser)
        assert sizes["doc"] <= sizes["inner"], sizes
        shot = tmp_path / f"chat_{width}x{height}_panels.png"
        browser.save_screenshot(str(shot))
        print(f"screenshot {width}x{height}, settings and sidebar toggled: {shot}")
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
