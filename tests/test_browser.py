"""A real browser against `streamlit run app.py`: Debian Chromium driven by Playwright (sync API).

The server starts with a fresh model cache (its first page converts the embedded GGUF, as on a new user's
machine). Opens every page through the app's own navigation (one session throughout), uploads a file, sends a
chat message and waits for both answers, runs a small needle grid, a perplexity run and a drift run, and takes a
screenshot of each page into a temporary folder; checks that a needle grid's time estimate, once earlier grids
measured this machine's speed, is within 2x of the time the grid then took; clicks a suggested question on the
bundled document and checks the right full-precision answer and the per-token comparison. Every wait has a
timeout and the server is always killed. With KVDEMO_SCREENSHOTS=assets/screenshots the screenshots go there instead, at larger sizes
(this is how the README's screenshots are refreshed):

    KVDEMO_SCREENSHOTS=assets/screenshots .venv/bin/python -m pytest -q tests/test_browser.py

Chromium comes from Debian (`make browser`); Playwright's own browser download is never used.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_S = 90  # the server answering its health check
MODEL_WORK_S = 300  # one step of model work on 2 busy CPU cores (the first load converts the GGUF)
UI_S = 30  # a widget or page appearing
REFRESH = os.environ.get("KVDEMO_SCREENSHOTS", "")
# Test sizes are tiny; the README's screenshots use sizes that show what the pages are for.
SIZES = (
    {"max_new": "40", "lengths": "512,1024,2048", "depths": "0,50,100", "drift_tokens": "512", "drift_new": "8"}
    | {"ppl_tokens": "2048"}
    if REFRESH
    else {"max_new": "6", "lengths": "160", "depths": "50", "drift_tokens": "64", "drift_new": "2", "ppl_tokens": "256"}
)
DOCUMENT = (
    "Meeting notes, 14 March. The budget review moved to Tuesday at 10 in room 4. Anna presents the travel "
    "costs, which rose by 12 percent since last year, mostly because of train fares. Ben asks for a new "
    "laptop for the design team. Clara reports that the new office in Porto opens in June with 18 desks. "
    "Action items: Anna sends the cost table by Friday; Ben gets three quotes; the next review is in May."
)

BOTH_COLUMNS_GROW = """() => {
  const seen = (window.kvdemoSeen = window.kvdemoSeen || {full: new Set(), int4: new Set()});
  const now = {};
  for (const el of document.querySelectorAll('[data-testid="stMarkdownContainer"]')) {
    const m = el.innerText.match(/^(full|int4)\\b/);
    if (m && el.innerText.includes("\u258c")) now[m[1]] = el.innerText.length;
  }
  if (now.full !== undefined && now.int4 !== undefined) {
    seen.full.add(now.full);
    seen.int4.add(now.int4);
  }
  return seen.full.size >= 2 && seen.int4.size >= 2;
}"""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.model,
    pytest.mark.timeout(3000 if REFRESH else 1500),  # README's sizes take longer
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason=f"Debian Chromium not found at {CHROMIUM} (run `make browser`)"
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`streamlit run app.py` on a free loopback port; yields its URL; always killed (the whole process group)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = os.environ | {"STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false", "TOKENIZERS_PARALLELISM": "false"}
    env |= {"KVDEMO_FINDINGS_QUICK_SIZES": "tiny", "KVDEMO_FINDINGS_CACHE": "0"}  # Findings re-runs: small, measured
    env |= {"KVDEMO_RATES_FILE": str(log_path.with_name("rates.json"))}  # time hints: this server's runs only
    # a fresh model cache: the first page converts the embedded GGUF, as a new user's first visit does
    env |= {"KVDEMO_CACHE_DIR": str(log_path.with_name("cache"))}
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true"]
    cmd += ["--server.port", str(port), "--server.address", "127.0.0.1"]
    cmd += ["--server.fileWatcherType", "none", "--server.runOnSave", "false"]  # other edits must not rerun it
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"streamlit did not answer within {SERVER_START_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=15)
        text = log_path.read_text(errors="replace")
        assert "Traceback" not in text, text[-3000:]


@pytest.fixture
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            ctx = browser.new_context(
                viewport={"width": 1400, "height": 1900 if REFRESH else 1000}
            )  # README: the figures too
            pg = ctx.new_page()
            pg.set_default_timeout(UI_S * 1000)
            yield pg
        finally:
            browser.close()


def idle(page, timeout_s: float = MODEL_WORK_S) -> None:
    """Wait until the script run finishes (Streamlit's status widget shows its running icon while it runs)."""
    page.wait_for_timeout(400)
    page.locator('[data-testid="stStatusWidgetRunningIcon"]').wait_for(state="hidden", timeout=timeout_s * 1000)


def no_exception(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]'
    ).first.inner_text()


def goto(page, title: str) -> None:
    """Switch page through the sidebar navigation (client side: the session, its chat and document stay)."""
    page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=title).click()
    idle(page)


def fill(page, label: str, value: str) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(value)
    box.press("Enter")
    idle(page)


def shoot(page, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    page.wait_for_timeout(500)  # let plotly finish drawing
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000, f"{path} looks empty"
    return path


def test_every_page_in_chromium(server, page, tmp_path):
    from playwright.sync_api import expect

    shots = Path(REFRESH) if REFRESH else tmp_path / "screenshots"
    shots = shots if shots.is_absolute() else ROOT / shots
    shots.mkdir(parents=True, exist_ok=True)

    page.goto(server, wait_until="domcontentloaded")
    page.get_by_text("KV bytes/token, full (").first.wait_for(timeout=MODEL_WORK_S * 1000)  # model loaded
    idle(page)
    no_exception(page)
    page.get_by_text("23,040 B").first.wait_for()
    shoot(page, shots, "home")

    # Chat: upload a file, send a message, both answers stream in.
    goto(page, "Chat")
    page.get_by_text("Chat with a document").first.wait_for()
    page.get_by_text("Upload a file").click()
    idle(page)
    doc = tmp_path / "meeting-notes.txt"
    doc.write_text(DOCUMENT)
    page.locator('[data-testid="stFileUploader"] input[type="file"]').set_input_files(str(doc))
    page.get_by_text(re.compile(r"meeting-notes\.txt: \d+ tokens")).wait_for(timeout=MODEL_WORK_S * 1000)
    idle(page)
    fill(page, "Longest answer (tokens)", SIZES["max_new"])
    chat = page.locator('[data-testid="stChatInput"] textarea')
    chat.fill("When is the budget review, and where?")
    chat.press("Enter")
    done = page.get_by_text(re.compile("First diverging token|Identical answers|No diverging token"))
    done.first.wait_for(timeout=MODEL_WORK_S * 1000)
    idle(page)
    no_exception(page)
    messages = page.locator('[data-testid="stChatMessage"]')
    expect(messages).to_have_count(3)  # the question and two answers
    assert page.get_by_text("full", exact=True).count() >= 1 and page.get_by_text("int4", exact=True).count() >= 1
    if REFRESH:  # a follow-up question, to show the cache reuse in the screenshot
        chat.fill("Who presents the travel costs?")
        chat.press("Enter")
        page.get_by_text(re.compile("from the cache")).first.wait_for(timeout=MODEL_WORK_S * 1000)
        idle(page)
    shoot(page, shots, "chat")

    # Another document while a conversation exists: the Document panel stays open and the app asks before
    # the new document ends the conversation.
    page.get_by_text("Bundled sample (Pride and Prejudice)").click()
    idle(page)
    page.get_by_text(re.compile(r"^Replace meeting-notes\.txt with Pride and Prejudice")).wait_for()
    page.get_by_role("button", name="Keep meeting-notes.txt").click()
    idle(page)
    expect(page.locator('[data-testid="stFileUploader"]')).to_be_visible()
    expect(messages).to_have_count(6 if REFRESH else 3)  # the conversation is kept (two turns with screenshots)
    no_exception(page)

    # Needle: a grid cancelled mid-way keeps the cells it finished and frees the model for the next run.
    goto(page, "Needle")
    fill(page, "Prompt lengths (tokens)", "1024,2048")
    fill(page, "Depths (% of the haystack)", "0,50,100")
    page.get_by_role("button", name="Run grid").click()
    page.get_by_text(re.compile(r"^[1-9][\d,]*/[\d,]+ tokens: ")).first.wait_for(
        timeout=MODEL_WORK_S * 1000
    )  # a row is done: the progress bar counts its tokens (the bar's text moves on to the next row at once)
    page.get_by_role("button", name="Cancel").click()
    cancelled = page.get_by_text(re.compile(r"Cancelled run \(partial\): \d+ of 24 runs in [\d.]+ s"))
    cancelled.first.wait_for(timeout=MODEL_WORK_S * 1000)
    idle(page)
    no_exception(page)

    # Needle: a small grid draws its heatmaps.
    fill(page, "Prompt lengths (tokens)", SIZES["lengths"])
    fill(page, "Depths (% of the haystack)", SIZES["depths"])
    page.get_by_role("button", name="Run grid").click()
    runs = len(SIZES["lengths"].split(",")) * len(SIZES["depths"].split(",")) * 4  # full, int8, int4, int2
    finished = page.get_by_text(re.compile(rf"passkey needle in filler: {runs} runs"))
    finished.wait_for(timeout=MODEL_WORK_S * 1000 * (4 if REFRESH else 1))
    idle(page, MODEL_WORK_S * (4 if REFRESH else 1))
    no_exception(page)
    expect(page.locator(".js-plotly-plot")).to_have_count(3)
    shoot(page, shots, "needle")

    # Perplexity of the held-out prose at the default precisions (the sidebar's, int4, nuq3:o1, int2).
    goto(page, "Perplexity")
    fill(page, "Text tokens", SIZES["ppl_tokens"])
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text(re.compile(r"Held-out prose \(Sense and Sensibility\): tokens [\d,]+ to [\d,]+ scored")).wait_for(
        timeout=MODEL_WORK_S * 1000 * (3 if REFRESH else 1)
    )
    idle(page)
    no_exception(page)
    expect(page.locator(".js-plotly-plot")).to_have_count(1)
    shoot(page, shots, "perplexity")

    # Memory & headroom: formulas at once, no model work needed.
    goto(page, "Memory & headroom")
    page.locator(".js-plotly-plot").nth(3).wait_for()  # at least four figures
    no_exception(page)
    shoot(page, shots, "memory")

    # Attention drift on the uploaded document.
    goto(page, "Attention drift")
    page.get_by_text("Current document: meeting-notes.txt").wait_for()
    fill(page, "Document tokens", SIZES["drift_tokens"])
    fill(page, "Generated tokens", SIZES["drift_new"])
    page.get_by_role("button", name="Run drift").click()
    page.locator(".js-plotly-plot").first.wait_for(timeout=MODEL_WORK_S * 1000 * (3 if REFRESH else 1))
    idle(page)
    no_exception(page)
    expect(page.locator(".js-plotly-plot")).to_have_count(4)
    shoot(page, shots, "drift")

    # Back on Chat: the conversation of this session is still there.
    goto(page, "Chat")
    page.get_by_text("When is the budget review, and where?").wait_for()
    turns = 6 if REFRESH else 3  # REFRESH asked a follow-up
    expect(page.locator('[data-testid="stChatMessage"]')).to_have_count(turns)

    # Leaving the page mid-answer stops the generation: the partial turn is kept, the model lock is
    # released, and the next question is answered.
    fill(page, "Longest answer (tokens)", "400")
    chat.fill("List every item in the notes, in detail.")
    chat.press("Enter")
    page.get_by_text("▌").first.wait_for(timeout=MODEL_WORK_S * 1000)  # tokens are streaming
    # Both columns receive tokens before either finishes: each streaming column (its cursor still shown)
    # is seen at two different lengths while the other one is streaming too.
    page.wait_for_function(BOTH_COLUMNS_GROW, timeout=MODEL_WORK_S * 1000, polling=100)
    goto(page, "Needle")
    goto(page, "Chat")
    page.get_by_text("List every item in the notes, in detail.").wait_for()
    page.get_by_text(re.compile("stopped")).first.wait_for()
    fill(page, "Longest answer (tokens)", "4")
    chat.fill("Where is the new office?")
    chat.press("Enter")
    expect(page.locator('[data-testid="stChatMessage"]')).to_have_count(turns + 6, timeout=MODEL_WORK_S * 1000)
    page.get_by_text("Where is the new office?").wait_for()
    idle(page)
    no_exception(page)
    names = {"chat.png", "drift.png", "home.png", "memory.png", "needle.png", "perplexity.png"}
    assert names <= {p.name for p in shots.glob("*.png")}  # the probe's shot is its own test's


def test_findings_quick_rerun_and_cancel(server, page):
    """Findings opens on the shipped report; a quick re-run shows progress, and Cancel keeps what finished."""
    page.goto(server, wait_until="domcontentloaded")
    idle(page)
    goto(page, "Findings")
    # the claims' headings (the verdict table's cells carry the same text, hidden in its canvas grid)
    page.get_by_role("heading", name="7. The trade-off and a recommendation").first.wait_for(
        timeout=MODEL_WORK_S * 1000
    )
    page.locator(".js-plotly-plot").first.wait_for(timeout=MODEL_WORK_S * 1000)
    no_exception(page)
    page.get_by_role("button", name="Re-run on the loaded model").click()
    one_done = re.compile(r"^[1-9][\d,]*/[\d,]+ tokens: ")  # the progress bar's count after one measurement
    page.get_by_text(one_done).first.wait_for(timeout=MODEL_WORK_S * 1000)
    page.get_by_role("button", name="Cancel").click()
    page.get_by_text(re.compile(r"Cancelled: \d+ of \d+ measurements kept")).first.wait_for(timeout=MODEL_WORK_S * 1000)
    idle(page)
    no_exception(page)
    page.get_by_role("heading", name="1. Capacity").first.wait_for(timeout=UI_S * 1000)  # the sections of what finished


def seconds_of(text: str) -> float:
    """The seconds of a `kvdemo.progress.duration` text: "45 s", "3 min 5 s", "2 min", "1 h 2 min"."""
    if text == "under a second":
        return 0.5
    units = {"h": 3600, "min": 60, "s": 1}
    return float(sum(int(n) * units[u] for n, u in re.findall(r"(\d+) (h|min|s)\b", text)))


def test_needle_time_estimate_is_within_2x_of_the_real_time(server, page):
    """The estimate shown before a grid comes from the speed this machine measured on the grids before it (the
    first grid may start from a probe or a first guess, and says so); it is within 2x of the time the third
    grid takes (the same grid: the speed measured on the two before it, the first of which also paid the
    server's one-time warm-up, on a busy shared CPU)."""
    page.goto(server, wait_until="domcontentloaded")
    page.get_by_text("KV bytes/token, full (").first.wait_for(timeout=MODEL_WORK_S * 1000)  # model loaded
    idle(page)
    goto(page, "Needle")
    page.get_by_text("Needle in a haystack").first.wait_for()
    fill(page, "Prompt lengths (tokens)", "256")
    fill(page, "Depths (% of the haystack)", "50")
    hint = re.compile(r"^About (.+?) for this grid \((.+?)\)\.$")
    runs = 4  # one cell x (full, int8, int4, int2)
    finished = re.compile(rf"passkey needle in filler: {runs} runs, ([\d.]+) s")
    took = []
    for attempt in range(3):
        shown = page.get_by_text(hint).first
        shown.wait_for(timeout=UI_S * 1000)
        estimate, source = hint.match(shown.inner_text()).groups()
        if attempt:  # the speed of the grids before, measured here
            assert source.startswith("from this machine's last"), source
        else:
            assert "first guess" in source or source.startswith("from this machine's last"), source
        page.get_by_role("button", name="Run grid").click()
        # the bar counts tokens and says the time left from the start (the estimate, then the run's own speed)
        page.get_by_text(re.compile(r" tokens: .* left\)$")).first.wait_for(timeout=MODEL_WORK_S * 1000)
        bar = page.locator('[data-testid="stProgress"]')
        bar.first.wait_for(state="detached", timeout=MODEL_WORK_S * 1000)  # the run ended
        heading = page.get_by_text(finished).first
        heading.wait_for(timeout=MODEL_WORK_S * 1000)
        idle(page)
        no_exception(page)
        took.append((seconds_of(estimate), float(finished.search(heading.inner_text()).group(1))))
    estimated, real = took[-1]
    assert real / 2 <= estimated <= real * 2, f"estimated {estimated} s, took {real} s (runs: {took})"


def test_chat_first_insight_suggested_question(server, page, tmp_path):
    """The first-insight path: the bundled sample, one click on a suggested question, the full-precision answer
    is right and each answer has its per-token comparison under it."""
    from playwright.sync_api import expect

    from kvdemo.chat.questions import SAMPLE_QUESTIONS
    from kvdemo.needle.prompts import answer_matches

    page.goto(server, wait_until="domcontentloaded")
    page.get_by_text("KV bytes/token, full (").first.wait_for(timeout=MODEL_WORK_S * 1000)  # model loaded
    idle(page)
    goto(page, "Chat")
    page.get_by_text("Chat with a document").first.wait_for()
    page.get_by_text(re.compile(r"Pride and Prejudice \(first 1,024 tokens\): [\d,]+ tokens")).wait_for(
        timeout=MODEL_WORK_S * 1000
    )
    idle(page)
    fill(page, "Longest answer (tokens)", "48")  # the quantized answer may loop: keep the run short
    first = SAMPLE_QUESTIONS[0]
    page.get_by_role("button", name=first.question).click()
    done = page.get_by_text(re.compile("First diverging token|Identical answers|No diverging token"))
    done.first.wait_for(timeout=3 * MODEL_WORK_S * 1000)
    idle(page)
    no_exception(page)
    expect(page.locator('[data-testid="stChatMessage"]')).to_have_count(3)  # the question and two answers
    full = page.locator('[data-testid="stChatMessage"]').nth(1).inner_text()
    assert "full" in full.splitlines()[:3] and answer_matches(first.expected, full), full
    strips = page.locator(".kv-strip")
    expect(strips).to_have_count(2)  # one per answer
    assert strips.first.locator(".kv-tok").count() >= 2
    expect(page.get_by_text(re.compile(r"^log p\(answer\):")).first).to_be_visible()
    expect(page.get_by_text(re.compile("KL\\(full \\|\\| quantized\\)")).first).to_be_visible()
    shoot(page, tmp_path, "chat_compare")  # never into REFRESH's folder: the README's set stays as it is


@pytest.mark.llamacpp
def test_api_probe_page_against_two_llamacpp_servers(server, page, tmp_path):
    """The API probe page in Chromium, probing llama.cpp's own server with an f16 cache and one with q4_0 (real
    engines on loopback), beside an endpoint that is not there: found rates, heatmaps, the difference map, the
    unreachable endpoint's message, and the downloads."""
    import contextlib

    from kvdemo.engines import KvTypes
    from kvdemo.models import embedded_gguf
    from kvdemo.probe.local import start_servers

    shots = Path(REFRESH) if REFRESH else tmp_path / "screenshots"
    shots = shots if shots.is_absolute() else ROOT / shots
    shots.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        kvs = [KvTypes("f16", "f16"), KvTypes("q4_0", "q4_0")]
        endpoints = start_servers(stack, embedded_gguf(), kvs, n_ctx=2048)
        lines = [f"{e.name}={e.base_url},{e.model}" for e in endpoints]
        lines.append(f"gone=http://127.0.0.1:{free_port()}/v1,nothing")
        page.goto(f"{server}/probe", wait_until="domcontentloaded")
        page.get_by_text("Add endpoints, set the grid").first.wait_for(timeout=MODEL_WORK_S * 1000)
        idle(page)
        box = page.get_by_label("Endpoints, one per line: NAME=BASE_URL,MODEL[,KEY_ENV]", exact=True)
        box.fill("\n".join(lines))
        box.press("Control+Enter")
        idle(page)
        fill(page, "Prompt lengths (estimated tokens)", "300,600" if not REFRESH else "300,600,900")
        fill(page, "Depths (% of the haystack)", "10,90" if not REFRESH else "0,50,100")
        page.get_by_role("button", name="Run probe").click()
        page.get_by_text(re.compile(r"passkey needle: \d+ cells")).first.wait_for(timeout=MODEL_WORK_S * 1000)
        idle(page)
    no_exception(page)
    page.get_by_text(re.compile(r"gone: cannot reach http://127\.0\.0\.1")).first.wait_for()
    page.get_by_text(re.compile(r"llama\.cpp-q4_0 against llama\.cpp-f16")).first.wait_for()
    assert page.locator('[data-testid="stPlotlyChart"]').count() == 2  # heatmaps and the difference map
    assert page.get_by_role("button", name="Download JSON").count() == 1
    shoot(page, shots, "probe")
