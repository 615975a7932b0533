"""The web page at /ui in headless Chromium (tests/browser.py): a streamed chat, the dashboard moving
under load, benchmark files drawn or refused, the API key asked for; no console error anywhere."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading

import httpx
import pytest
from selenium.webdriver.common.by import By

from tests.browser import console_errors, headless_chromium
from tests.live_server import MODEL_NAME, live_server, wait_until

CHINESE = "你好，世界！请用一句话介绍你自己。"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    results = tmp_path_factory.mktemp("ui-results")
    with live_server(llama_dir, ui_results_dir=str(results)) as live:
        live.results_dir = results
        yield live


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(autouse=True)
def no_console_errors(browser):
    console_errors(browser)  # drain what an earlier test left
    yield
    assert console_errors(browser) == []


def text_of(browser, element_id: str) -> str:
    return browser.find_element(By.ID, element_id).text


def set_value(browser, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def open_page(browser, url: str, view: str = "") -> None:
    """A fresh load of the page (a new hash alone would not reload it), on `view`."""
    browser.get("about:blank")
    browser.get(url + "/ui" + (f"#{view}" if view else ""))


def numbers(texts) -> list[float]:
    """The readings among a card's texts ("–" before the first poll)."""
    out = []
    for text in texts:
        try:
            out.append(float(text))
        except ValueError:
            pass
    return out or [float("nan")]


def test_a_chat_streams_into_the_page_and_equals_the_apis_answer(server, browser):
    open_page(browser, server.url, "")
    wait_until(lambda: MODEL_NAME in text_of(browser, "engine-summary"), 20, "the engine summary")
    set_value(browser, "temperature", "0")
    set_value(browser, "max-tokens", "12")
    set_value(browser, "message", CHINESE)
    browser.find_element(By.ID, "send").click()
    meta = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#conversation li.assistant .meta")
                      and browser.find_element(By.CSS_SELECTOR, "#conversation li.assistant .meta").text, 60,
                      "the answer's figures")
    assert "TTFT" in meta and "12 tokens" in meta and "from the prefix cache" in meta and "result cache" in meta
    assert browser.find_element(By.CSS_SELECTOR, "#conversation li.user .content").text == CHINESE
    messages = browser.execute_script("return state.messages")
    expected = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": CHINESE}], "temperature": 0, "top_p": 1,
        "max_tokens": 12}).json()["choices"][0]["message"]["content"]
    assert messages == [{"role": "user", "content": CHINESE}, {"role": "assistant", "content": expected}]
    browser.find_element(By.ID, "clear").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#conversation li") == []


def test_markdown_renders_code_blocks_and_escapes_html(server, browser):
    open_page(browser, server.url, "")
    html = browser.execute_script("return renderMarkdown(arguments[0])",
                                  "**bold** and `x<y`\n```python\nprint('<b>')\n```\n- one\n- two")
    assert html == ("<p><strong>bold</strong> and <code>x&lt;y</code></p>"
                    "<pre><code class=\"language-python\">print(&#39;&lt;b&gt;&#39;)\n</code></pre>"
                    "<ul><li>one</li><li>two</li></ul>")


def test_the_dashboard_moves_while_load_runs(server, browser):
    open_page(browser, server.url, "dashboard")
    wait_until(lambda: numbers([text_of(browser, "card-running")]) == [0.0], 20, "the first poll")
    finished_before = float(httpx.get(server.url + "/v1/llmaccel/stats").json()["totals"]["requests_finished"])

    stop, answered = threading.Event(), []

    def load(worker: int) -> None:
        """Requests back to back until told to stop: the page is sampled while load runs, however fast."""
        while not stop.is_set():
            body = {"prompt": f"Load {worker}", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
            answered.append(httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code)

    def seen_moving() -> bool:
        running = numbers([text_of(browser, "card-running")])[0]
        rate = numbers([text_of(browser, "card-output_tokens_per_s")])[0]
        return running >= 1 and rate > 0  # sequences running and tokens flowing, in one poll

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        workers = [pool.submit(load, i) for i in range(8)]
        try:
            wait_until(seen_moving, 60, "the dashboard showing running sequences and a token rate")
        finally:
            stop.set()
        for worker in workers:
            worker.result()
    assert answered and set(answered) == {200}
    read_finished = ("for (const row of document.querySelectorAll('#totals tr')) "
                     "if (row.cells[0].textContent === 'requests finished') return Number(row.cells[1].textContent);")
    wait_until(lambda: (browser.execute_script(read_finished) or 0) >= finished_before + len(answered), 10,
               "the finished count")  # read in one script: the poll replaces the table's rows
    assert len(browser.find_elements(By.CSS_SELECTOR, "#charts canvas")) == 6


def test_the_dashboard_shows_the_kv_disk_tier(llama_dir, browser, tmp_path):
    options = {"kv_offload_dir": str(tmp_path), "kv_offload_policy": "write-through"}
    with live_server(llama_dir, engine_options=options) as tiered:
        body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 2}
        assert httpx.post(tiered.url + "/v1/completions", json=body, timeout=60).status_code == 200
        files = wait_until(lambda: httpx.get(tiered.url + "/v1/llmaccel/stats").json()["kv_tiers"]["disk"]["files"],
                           10, "the tier's first files")
        open_page(browser, tiered.url, "dashboard")
        read_tier = ("for (const row of document.querySelectorAll('#totals tr')) "
                     "if (row.cells[0].textContent === 'KV disk tier') return row.cells[1].textContent;")
        text = wait_until(lambda: browser.execute_script(read_tier), 20, "the disk tier's row")
        browser.get("about:blank")  # stop the page's polling before this server goes away
    assert text.startswith(f"{files:.0f} blocks (0.00 GiB); written {files:.0f} (")
    assert text.endswith("read back 0, refused 0, failed writes 0")


def _sweep(server, out_dir, label: str) -> list:
    command = [sys.executable, "-m", "llmaccel.cli", "bench", "sweep", "--base-url", server.url, "--model",
               MODEL_NAME, "--label", label, "--concurrency", "1,2", "--num-prompts", "2", "--output-len", "8",
               "--ignore-eos", "--result-dir", str(out_dir)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return sorted(out_dir.glob("*.json"))


def test_benchmark_files_draw_curves_and_a_bad_file_is_an_error_in_the_page(server, browser, tmp_path):
    files = _sweep(server, tmp_path / "a", "tiny-a")
    assert len(files) == 2
    bad_json = tmp_path / "broken.json"
    bad_json.write_text('{"output_throughput": 1,')
    wrong_shape = tmp_path / "other.json"
    wrong_shape.write_text(json.dumps({"hello": "world"}))
    open_page(browser, server.url, "benchmarks")
    upload = browser.find_element(By.ID, "bench-files")
    upload.send_keys("\n".join(str(f) for f in files))
    wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#bench-table tbody tr")) == 2, 10, "two rows")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#bench-charts canvas")) == 2
    labels = {row.find_elements(By.TAG_NAME, "td")[1].text
              for row in browser.find_elements(By.CSS_SELECTOR, "#bench-table tbody tr")}
    assert labels == {"tiny-a"}
    drawn = browser.execute_script("const c = document.querySelector('#bench-tpot canvas');"
                                   "return c.getContext('2d').getImageData(0, 0, c.width, c.height).data"
                                   ".some((v, i) => i % 4 === 3 && v > 0)")
    assert drawn  # the curve is on the canvas, not a blank one
    assert browser.find_element(By.ID, "bench-error").is_displayed() is False
    upload.send_keys(f"{bad_json}\n{wrong_shape}")
    error = wait_until(lambda: text_of(browser, "bench-error"), 10, "the error")
    assert "broken.json: not JSON" in error and "other.json: not a result of bench serve" in error
    assert len(browser.find_elements(By.CSS_SELECTOR, "#bench-table tbody tr")) == 2  # the good runs stay


def test_the_results_directory_is_listed_and_loads(server, browser):
    _sweep(server, server.results_dir, "tiny-dir")
    open_page(browser, server.url, "benchmarks")
    wait_until(lambda: browser.find_element(By.ID, "bench-dir").is_displayed(), 10, "the directory list")
    options = browser.find_elements(By.CSS_SELECTOR, "#bench-dir-list option")
    assert [o.text for o in options] == sorted(p.name for p in server.results_dir.glob("*.json"))
    browser.execute_script("for (const o of document.getElementById('bench-dir-list').options) o.selected = true")
    browser.find_element(By.ID, "bench-dir-load").click()
    wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#bench-table tbody tr")) >= 2, 10, "rows")
    outside = httpx.get(server.url + "/v1/llmaccel/results/..%2F..%2Fetc%2Fpasswd")
    assert outside.status_code == 404 and "not a result file" in outside.json()["error"]["message"]


def test_the_page_asks_for_the_key_and_then_works(llama_dir):
    with live_server(llama_dir, api_keys=("sesame",)) as keyed, headless_chromium() as driver:
        driver.get(keyed.url + "/ui")
        wait_until(lambda: driver.find_element(By.ID, "key-form").is_displayed(), 20, "the key form")
        assert "API key" in driver.find_element(By.ID, "error").text
        driver.find_element(By.ID, "api-key").send_keys("sesame")
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_until(lambda: MODEL_NAME in driver.find_element(By.ID, "engine-summary").text, 20, "the summary")
        assert not driver.find_element(By.ID, "key-form").is_displayed()
        unexpected = console_errors(driver, allowed=lambda message: "status of 401" in message)
        assert unexpected == []


def test_no_ui_turns_the_page_off(llama_dir):
    with live_server(llama_dir, ui=False) as plain:
        assert httpx.get(plain.url + "/ui").status_code == 404
        assert httpx.get(plain.url + "/v1/llmaccel/stats").status_code == 200


def test_every_view_fits_a_phone_and_charts_follow_their_width(server, browser, tmp_path):
    """At 390 px nothing scrolls sideways (wide tables scroll in their own box); a chart whose box changes
    width (a neighbour arrives, the phone turns) is redrawn at its new width, not stretched."""
    files = _sweep(server, tmp_path, "tiny-phone")
    bitmaps_match = ("return [...document.querySelectorAll('#bench-charts canvas')].map("
                     "(c) => c.width === Math.round(c.clientWidth * (window.devicePixelRatio || 1)))")
    sideways = "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    browser.set_window_size(390, 844)
    try:
        for view in ("", "dashboard", "benchmarks"):
            open_page(browser, server.url, view)
            wait_until(lambda: MODEL_NAME in text_of(browser, "engine-summary"), 20, "the engine summary")
            if view == "dashboard":
                wait_until(lambda: numbers([text_of(browser, "card-running")]) == [0], 20, "the first poll")
            if view == "benchmarks":
                browser.find_element(By.ID, "bench-files").send_keys("\n".join(str(f) for f in files))
                wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#bench-table tbody tr")) == 2, 10,
                           "the table")
            assert browser.execute_script(sideways) <= 0, view
        browser.set_window_size(1280, 900)  # the phone turns: the charts now share a row
        wait_until(lambda: browser.execute_script(bitmaps_match) == [True, True], 5, "charts redrawn at their width")
    finally:
        browser.set_window_size(1280, 900)
