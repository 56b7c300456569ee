"""The web page at / in a real headless Chromium (Playwright driving the system's browser), on a
real `kiln serve` of the tiny Llama, a tiny embedding model and a tiny classifier behind --api-key:
the page asks for the key, lists the models, streams a chat answer as it arrives (and one shaped by a
JSON schema), computes an embedding, classifies a text, and its figures from /metrics move while
requests run. Skipped where no Chromium is installed (CI installs Debian's: .ci/run).
KILN_UI_SCREENSHOT=PATH keeps a screenshot of the page after the chat (docs/web-ui.png, of real
models, comes from benchmarks/tour/ui_screenshot.py)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from servers import Server

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
CHROMIUM = os.environ.get("KILN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(not CHROMIUM, reason="no Chromium installed (apt-get install chromium; the "
                                                     "test drives the system's browser, never a downloaded one)")
# Nothing but this machine's server: no component updates, sync, QUIC or first-run pages.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_MS = 20_000
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(zoo, tiny_generation_artifact):
    embedder = zoo.artifact("bert", "sentence-embeddings", precisions=("fp32",))
    classifier = zoo.artifact("bert", "text-classification", precisions=("fp32",))
    srv = Server([f"chat={tiny_generation_artifact}", f"emb={embedder}", f"cls={classifier}", "--variant", "fp32",
                  "--no-warmup"], env={"KILN_API_KEY": KEY})
    yield srv
    code, err = srv.stop()
    assert code == 0, err[-2000:]


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url + "/")
        yield page
        browser.close()
    assert not errors, errors  # no uncaught script error in the whole session


def figure_values(page, name: str) -> list[float]:
    values = page.get_attribute(f"#fig-{name} canvas", "data-values") or ""
    return [float(v) for v in values.split(",") if v]


def test_the_page_asks_for_the_key_then_lists_the_models(page):
    page.locator("#key-note").wait_for(state="visible")  # /v1/models answered 401
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    page.wait_for_function("() => document.querySelectorAll('#models-body tr').length === 3")
    rows = page.locator("#models-body tr").all_inner_texts()
    assert any(r.startswith("chat") and "text-generation" in r for r in rows), rows
    assert any(r.startswith("emb") and "sentence-embeddings" in r and "dimensions" in r for r in rows), rows
    assert any(r.startswith("cls") and "text-classification" in r and "2 labels" in r for r in rows), rows
    assert page.is_hidden("#key-note")
    assert page.input_value("#chat-model") == "chat" and page.input_value("#encode-model") == "emb"


def test_a_chat_answer_streams_in(page):
    # every change of the answer's text, as the browser saw it
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const answer = document.querySelector('#chat-log .msg.assistant:last-child');
            if (answer) window.seen.push(answer.firstChild ? answer.firstChild.textContent.length : 0);
        }).observe(document.getElementById('chat-log'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "48")
    page.click("#chat-form summary")  # the system prompt and schema fields fold away
    page.fill("#chat-system", "You are terse.")
    page.fill("#chat-input", "The quick brown fox")
    page.press("#chat-input", "Enter")  # Enter sends
    meta = page.locator("#chat-log .msg.assistant .meta")
    meta.wait_for()
    assert "tokens" in meta.inner_text() and "first after" in meta.inner_text()
    answer = page.locator("#chat-log .msg.assistant").inner_text()
    seen = page.evaluate("window.seen")
    grown = sorted({n for n in seen if n})
    assert len(grown) >= 3, (seen, answer)  # written piece by piece, not at once
    assert page.locator("#chat-log .msg.user").inner_text() == "The quick brown fox"
    assert page.is_disabled("#chat-stop") and page.is_enabled("#chat-send")
    shot = os.environ.get("KILN_UI_SCREENSHOT")
    page.screenshot(path=shot or str(Path(os.environ.get("TMPDIR", "/tmp")) / "kiln-ui.png"))


def test_a_json_schema_shapes_the_answer(page):
    page.click("#chat-clear")
    page.fill("#chat-schema", json.dumps(SCHEMA))
    page.fill("#chat-input", "Where?")
    page.press("#chat-input", "Enter")
    page.locator("#chat-log .msg.assistant .meta").wait_for()
    answer = json.loads(page.evaluate("() => document.querySelector('#chat-log .msg.assistant').firstChild.textContent"))
    assert set(answer) == {"city"} and len(answer["city"]) <= 10, answer
    page.fill("#chat-schema", "{not json")
    page.fill("#chat-input", "Again")
    page.press("#chat-input", "Enter")
    assert "not JSON" in page.inner_text("#chat-status")  # said at once, nothing sent
    assert page.locator("#chat-log .msg.user").count() == 1
    page.fill("#chat-schema", "")


def test_an_embedding_is_computed(page):
    page.fill("#encode-text", "A man is playing a flute.")
    page.click("#encode-form button[type=submit]")
    result = page.locator("#encode-result")
    page.wait_for_function("() => document.getElementById('encode-result').textContent.includes('dimensions')")
    text = result.inner_text()
    assert "norm" in text and text.count(",") >= 7, text  # the size and the first values


def test_a_text_is_classified(page):
    page.select_option("#encode-model", "cls")
    page.click("#encode-form button[type=submit]")
    page.locator("#encode-result .score").first.wait_for()
    rows = page.locator("#encode-result .score").all_inner_texts()
    assert sorted(r.split()[0] for r in rows) == ["negative", "positive"], rows  # every label with its score
    assert abs(sum(float(r.split()[-1]) for r in rows) - 1) < 1e-3, rows


def test_the_figures_move_while_requests_run(page, server):
    stop = threading.Event()

    def load(kind: str) -> None:
        while not stop.is_set():
            if kind == "chat":
                httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=30, json={
                    "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32,
                    "ignore_eos": True})
            else:
                httpx.post(server.url + "/v1/embeddings", headers=AUTH, timeout=30, json={"model": "emb", "input": "x"})

    # the samples taken from now on (the page is younger than a sparkline's 60 samples)
    before = {name: len(figure_values(page, name)) for name in ("rps", "tps")}
    threads = [threading.Thread(target=load, args=(kind,)) for kind in ("chat", "chat", "emb")]
    for t in threads:
        t.start()
    try:
        # (the tiny model's streams are too short for the queue's once-a-second sample to catch them running)
        page.wait_for_function("""(before) => Object.entries(before).every(([id, n]) =>
            (document.querySelector(`#fig-${id} canvas`).dataset.values || '').split(',').slice(n + 1)
                .some((v) => Number(v) > 0))""", arg=before)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert max(figure_values(page, "rps")) > 0 and max(figure_values(page, "tps")) > 0
    assert len(figure_values(page, "queue")) >= 2  # sampled every second
    assert page.inner_text("#fig-kv output").endswith("%")  # the chat model's KV cache
    assert page.inner_text("#live-status") == ""
