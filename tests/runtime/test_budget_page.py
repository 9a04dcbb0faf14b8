"""The live budget page (``GET /``) against ``/v1/budget`` on a real engine.

Every number the page shows is an element with ``data-path`` (where it is in
``/v1/budget``) and ``data-value``; the checks read the page's numbers back and compare
them with the document: the value at the path, the text as ``moefit.units.format_bytes``
writes bytes, rates in percent to one decimal; the shared KV pool's bar has its cells'
shares (reserved, held by idle slots, free). The server has four slots over a pool of two
contexts, after two requests; one without a pool shows no pool section. Without a browser
the page's own render script runs in V8 (mini-racer) on the server's document; with
Chromium installed, headless Chromium loads the page from a served app, runs its script,
and the DOM and a screenshot are checked (``MOEFIT_PAGE_SCREENSHOT=docs/budget-page.png``
keeps the screenshot there).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from html.parser import HTMLParser

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from conftest import plan_for  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.serve.app import ServerState, create_app  # noqa: E402
from moefit.serve.text import GenerationDefaults, Tokenizer  # noqa: E402
from moefit.units import format_bytes  # noqa: E402
from serving import make_servable  # noqa: E402

#: /v1/budget's fields that are bytes (the route's docstring, docs/serve.md)
BYTE_FIELDS = {"planned", "allocated", "peak", "used_peak", "capacity_bytes", "limit_bytes",
               "free_bytes", "margin_bytes"}


#: the page's server: four slots sharing a KV pool of two contexts (--parallel 4 --kv-pool 512)
SLOTS, CONTEXT, POOL = 4, 256, 512


def _state(d, **req):
    tiny = make_servable(d, max_position_embeddings=1024)
    plan = plan_for(tiny, max_context=CONTEXT, expert_cache=8, **req)
    tok = Tokenizer.from_dir(d)
    st = ServerState(plan=plan, model_name="tiny", tokenizer=tok,
                     defaults=GenerationDefaults.from_dir(d, tok))
    st.engine = Engine.start(d, plan, EngineOptions(progress=False))
    return st


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    st = _state(tmp_path_factory.mktemp("page"), slots=SLOTS, kv_pool=POOL)
    with TestClient(create_app(st)) as c:      # some traffic: hits, misses, KV cells in use
        for prompt in ("the quick brown fox", "hello world how are you"):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6})
            assert r.status_code == 200, r.text
    return st


class Numbers(HTMLParser):
    """``(path, data-value, text)`` of every element with ``data-path``."""

    def __init__(self):
        super().__init__()
        self.found, self._open = [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-path" in a:
            self._open = [a["data-path"], a["data-value"], ""]

    def handle_data(self, data):
        if self._open is not None:
            self._open[2] += data

    def handle_endtag(self, tag):
        if self._open is not None:
            self.found.append(tuple(self._open))
            self._open = None


def numbers(html: str) -> list[tuple[str, str, str]]:
    p = Numbers()
    p.feed(html)
    return p.found


def at(doc, path: str):
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def check_numbers(found, doc) -> set[str]:
    """Every number shown equals the document's at its path, and reads as it should; the
    paths shown."""
    assert found, "the page shows no numbers"
    for path, value, text in found:
        want = at(doc, path)
        assert float(value) == want, (path, value, want)
        field = path.split(".")[-1]
        if field in BYTE_FIELDS or field.endswith("_bytes"):
            assert text == format_bytes(want), (path, text, want)
        elif field.endswith("rate"):
            assert text.endswith("%") and abs(float(text[:-1]) - 100 * want) <= 0.05, (path, text)
        else:
            assert text == str(want), (path, text, want)
    return {p for p, _, _ in found}


def required_paths(doc) -> set[str]:
    """What the page must show: planned / allocated / peak of every line of every ledger,
    the hit rate of every layer, the slots' queue and the KV cells per slot."""
    need = {"slots.queued", "slots.busy", "experts.hit_rate"}
    ledgers = [(f"ledgers.{i}", lg) for i, lg in enumerate(doc["ledgers"])]
    if doc.get("host_ledger"):
        ledgers.append(("host_ledger", doc["host_ledger"]))
    for base, lg in ledgers:
        for i, _ in enumerate(lg["lines"]):
            need |= {f"{base}.lines.{i}.{k}" for k in ("planned", "allocated", "peak")}
    need |= {f"experts.layers.{i}.hit_rate" for i in range(len(doc["experts"]["layers"]))}
    need |= {f"slots.kv_cells_in_use.{i}" for i in range(len(doc["slots"]["kv_cells_in_use"]))}
    if doc.get("kv_pool") is not None:
        need |= {f"kv_pool.{k}" for k in POOL_FIELDS}
    return need


#: /v1/budget's ``kv_pool`` (docs/serve.md, Scheduler.pool_figures)
POOL_FIELDS = ("cells", "used", "reserved", "tokens", "slots", "context", "block", "waiting")


def check_pool_bar(html: str, pool: dict) -> None:
    """The KV pool's bar: its segments' widths are the pool's cells reserved by running
    requests, held by idle slots (used - reserved) and free (cells - used), in percent of
    ``cells``."""
    found = dict(re.findall(r'<div class="(pool-reserved|pool-kept|pool-free)" '
                            r'style="width: ?([0-9.]+)%', html))
    cells, used, reserved = pool["cells"], pool["used"], pool["reserved"]
    want = {"pool-reserved": reserved, "pool-kept": used - reserved, "pool-free": cells - used}
    assert set(found) == set(want), ("no bar of the KV pool's cells", found)
    for k, n in want.items():
        assert abs(float(found[k]) - 100 * n / cells) < 1e-3, (k, found[k], n, cells)


def page_script(html: str, name: str) -> str:
    m = re.search(rf'<script id="{name}">(.*?)</script>', html, re.S)
    assert m, f"no <script id={name!r}> in the page"
    return m.group(1)


def test_page_is_served_self_contained_and_holds_no_data(state):
    with TestClient(create_app(state)) as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in r.headers["content-security-policy"]
        html = r.text
    # nothing fetched from elsewhere (the machine may be offline): no external address, no
    # src / href attribute, no stylesheet link
    assert not re.search(r"https?://", html), re.findall(r"https?://\S+", html)
    assert not re.search(r"\b(src|href)\s*=", html)
    assert "/v1/budget" in html
    # no data of its own: the model's name appears only once the script has read the budget
    assert state.plan.geometry.name not in html and numbers(html) == []


@pytest.fixture(scope="module")
def no_pool(tmp_path_factory):
    """A server whose slots own their KV cells (--parallel 2, no --kv-pool)."""
    return _state(tmp_path_factory.mktemp("nopool"), slots=2)


def test_page_numbers_equal_v1_budget_without_a_browser(state, no_pool):
    MiniRacer = pytest.importorskip("py_mini_racer", reason="mini-racer (the test extra) "
                                    "runs the page's script without a browser").MiniRacer
    with TestClient(create_app(state)) as c:
        html = c.get("/").text
        doc = c.get("/v1/budget").json()
    assert doc["experts"]["hits"] + doc["experts"]["misses"] > 0
    with MiniRacer() as js:
        js.eval(page_script(html, "render"))
        out = js.call("render", doc)
        shown = check_numbers(numbers(out), doc)
        assert required_paths(doc) <= shown, sorted(required_paths(doc) - shown)
        pool = doc["kv_pool"]
        assert (pool["cells"], pool["slots"], pool["context"]) == (POOL, SLOTS, CONTEXT)
        assert 0 < pool["used"] < pool["cells"]          # idle slots keep their prompts' cells
        check_pool_bar(out, pool)
        # a request running: cells reserved, tokens written, one waiting for cells
        busy = copy.deepcopy(doc)
        busy["kv_pool"].update(reserved=pool["used"] // 2, tokens=pool["used"] // 3, waiting=1)
        out = js.call("render", busy)
        assert required_paths(busy) <= check_numbers(numbers(out), busy)
        check_pool_bar(out, busy["kv_pool"])
        # a field added to kv_pool after the page still shows, by its name
        extra = copy.deepcopy(doc)
        extra["kv_pool"]["table_bytes"] = 3 << 20
        assert "kv_pool.table_bytes" in check_numbers(numbers(js.call("render", extra)), extra)
        # a server without --kv-pool (kv_pool null): no pool section
        with TestClient(create_app(no_pool)) as c:
            plain = c.get("/v1/budget").json()
        assert plain["kv_pool"] is None
        out = js.call("render", plain)
        assert "KV pool" not in out and "kv_pool" not in out
        assert required_paths(plain) <= check_numbers(numbers(out), plain)
        # labels are escaped: a device name is text, not markup
        odd = copy.deepcopy(doc)
        odd["ledgers"][0]["device"] = "<img onerror=x>"
        assert "<img" not in js.call("render", odd)


def test_page_with_an_api_key_asks_for_it(state):
    keyed = ServerState(plan=state.plan, model_name="tiny", tokenizer=state.tokenizer,
                        defaults=state.defaults, engine=state.engine, api_key="sekrit")
    with TestClient(create_app(keyed)) as c:
        open_page = c.get("/")
        assert open_page.status_code == 200
        assert c.get("/v1/budget").status_code == 401
        assert c.get("/v1/budget", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert "sekrit" not in open_page.text and numbers(open_page.text) == []
    # what the server says before READY names every route that answers without the key
    from moefit.serve.launch import KEY_LINE, OPEN_ROUTES

    with TestClient(create_app(keyed)) as c:
        assert all(c.get(route).status_code == 200 for route in OPEN_ROUTES)
    assert "(/, /health and /metrics stay open)" in KEY_LINE
    live = page_script(open_page.text, "live")
    assert "r.status === 401" in live and "Authorization" in live


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


@pytest.fixture
def http_server(state):
    """The app on a loopback port (uvicorn in a thread), for a browser."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="Chromium is not installed (apt-get install "
                    "chromium; .ci/run installs it where apt-get can): the page's numbers are "
                    "still checked without a browser")
def test_page_in_headless_chromium(state, http_server, tmp_path):
    import httpx

    browser = _chromium()
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000"]
    url = http_server + "/?every=60"
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    doc = httpx.get(http_server + "/v1/budget").json()
    assert 'data-rendered="1"' in dom, dom[-2000:]
    shown = check_numbers(numbers(dom), doc)
    assert required_paths(doc) <= shown, sorted(required_paths(doc) - shown)
    assert doc["kv_pool"]["used"] > 0
    check_pool_bar(dom, doc["kv_pool"])
    assert f'id="model" class="muted">{doc["plan"]["model"]["name"]}<' in dom   # from the budget
    shot = tmp_path / "budget-page.png"
    subprocess.run([*flags, "--window-size=1000,1500", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    print(f"screenshot of the budget page: {shot}")
    keep = os.environ.get("MOEFIT_PAGE_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
