"""The console (``/ui``) in a real browser: Debian's headless Chromium driven by Playwright's bundled
driver (``executable_path``: nothing downloads a browser), against one live Serve app with API keys
(``bench/scenarios/console_app.py``). The playground generates an image and runs a video job to
completion with a visible progress bar, and cancels another; the operator view, with an admin key
(a user key gets the 403 message), shows every served template's plan row and trace plot and its
queue numbers move under a burst. Every request the browser makes is recorded: all go to the app.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from bench.scenarios.console_app import ADMIN_KEY, COG, FLUX, USER_KEY, app_args, app_table, browser, chromium_path

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

if chromium_path() is None:
    pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run installs it)", allow_module_level=True)
from bench.scenarios.serve_app import running_app


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    args = app_args(tmp_path_factory.mktemp("jobs"))
    with running_app(args, app_table(args), tmp_path_factory.mktemp("plans")) as url:
        # the operator view's first trace builds the models' meta pipelines in the Router: start it now
        with cf.ThreadPoolExecutor(2) as pool:
            warm = [pool.submit(requests.get, f"{url}/v1/console/traces/{t.shape_key}",
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120) for t in (FLUX, COG)]
            yield url
            for w in warm:
                w.result()


@pytest.fixture(scope="module")
def chrome() -> Iterator[Any]:
    with browser() as b:
        yield b


def until(page: Any, js: str, timeout_s: float = 30.0) -> None:
    """Poll ``js`` (an expression) until it is truthy. Not ``page.wait_for_function``: its polling
    evaluates strings with ``eval``, which the console's Content-Security-Policy forbids (and the
    test keeps the policy on, so the pages are tested under it)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(js):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s: {js}")
        time.sleep(0.05)


class Page:
    """A fresh browser context (its own localStorage) whose every request URL is recorded."""

    def __init__(self, chrome: Any, base: str) -> None:
        self.ctx = chrome.new_context(viewport={"width": 1366, "height": 900})
        self.page = self.ctx.new_page()
        self.urls: list[str] = []
        self.page.on("request", lambda r: self.urls.append(r.url))
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.base = base

    def set_key(self, key: str) -> None:
        self.page.fill("#api-key", key)
        self.page.click("#key-save")

    def only_own_host(self) -> None:
        host = urlsplit(self.base).netloc
        away = [u for u in self.urls if urlsplit(u).scheme not in ("blob", "data") and urlsplit(u).netloc != host]
        assert not away, f"requests left the app's host: {away}"
        assert self.urls, "no request recorded"
        assert not self.errors, self.errors

    def close(self) -> None:
        self.ctx.close()


def test_playground_image_video_and_cancel(server: str, chrome: Any) -> None:
    p = Page(chrome, server)
    page = p.page
    page.goto(f"{server}/ui")
    page.wait_for_selector("#status.error")  # without a key the page says it needs one
    assert "API key" in page.text_content("#status")
    p.set_key(USER_KEY)
    until(page, "document.querySelectorAll('#model option').length == 2")
    # the key is kept: a reload needs no typing
    page.reload()
    until(page, "document.querySelectorAll('#template option').length >= 1")
    page.select_option("#model", FLUX.model)
    option = page.text_content("#template option")
    assert "steps" in option and "GB" in option and " s " in option  # predicted latency and peak beside it

    page.click("#submit")
    page.wait_for_selector("#out-image", timeout=60_000)
    size = page.evaluate("(() => { const i = document.querySelector('#out-image'); return [i.naturalWidth, i.naturalHeight]; })()")
    assert size == [FLUX.width, FLUX.height]
    assert page.get_attribute("#download", "download") == "xema.png"

    page.select_option("#model", COG.model)
    page.click("#submit")
    page.wait_for_selector("#progress", state="visible")
    seen = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not page.query_selector("#out-video"):
        seen.add(int(page.get_attribute("#progress", "aria-valuenow") or 0))
        time.sleep(0.05)
    assert page.query_selector("#out-video"), page.text_content("#status")
    assert len([v for v in seen if 0 < v < 100]) >= 1, f"no intermediate progress seen: {sorted(seen)}"
    assert "step" in page.text_content("#job-line")
    until(page, "document.querySelector('#out-video').readyState >= 1", 20)
    assert page.evaluate("document.querySelector('#out-video').videoWidth") == COG.width
    assert page.get_attribute("#download", "download").endswith(".mp4")

    # a second job, cancelled while it runs: at 200 steps (the range's top) it cannot finish first
    assert page.is_enabled("#steps")
    page.fill("#steps", "200")
    page.click("#submit")
    page.wait_for_selector("#cancel", state="visible")
    job = page.text_content("#job-line").split(" ")[0]
    until(page, "parseInt(document.querySelector('#progress').getAttribute('aria-valuenow')) > 0 "
                           "|| document.querySelector('#job-line').textContent.includes('in_progress')", 30)
    page.click("#cancel")
    until(page, "document.querySelector('#job-line').textContent.includes('cancelled')")
    assert page.is_hidden("#cancel")
    gone = requests.get(f"{server}/v1/videos/{job}", headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=30)
    assert gone.status_code == 404  # deleted: the job is gone from the store
    p.only_own_host()
    p.close()


def test_operator_view_plans_traces_and_live_queues(server: str, chrome: Any) -> None:
    p = Page(chrome, server)
    page = p.page
    page.goto(f"{server}/ui/operator.html?refresh=0.5")
    p.set_key(USER_KEY)  # a tenant's key is not enough
    until(page, "document.querySelector('#status').textContent.includes('not an admin key')")
    p.set_key(ADMIN_KEY)
    for t in (FLUX, COG):  # every served template: its plan row and its trace plot
        page.wait_for_selector(f"table.plans tr[data-template='{t.shape_key}']", timeout=30_000)
        page.wait_for_selector(f".trace-card[data-template='{t.shape_key}'] svg.trace path.mitigated", timeout=90_000)
    cog_card = f".trace-card[data-template='{COG.shape_key}']"
    assert page.query_selector_all(f"{cog_card} rect.pressure"), "CogVideoX's trace shows no pressure interval"
    assert page.query_selector(f"{cog_card} rect.mitigation"), "the plan's mitigation is not placed on the trace"
    assert page.query_selector(f"{cog_card} line.budget")
    row = page.text_content(f"table.plans tr[data-template='{COG.shape_key}']")
    assert "vae_chunking" in row and "not armed" in row

    queued = f"section.group[data-model='{FLUX.model}'] [data-stat='queued'] b"
    assert page.text_content(queued) == "0"
    body = {"model": FLUX.model, "prompt": "burst", "size": f"{FLUX.width}x{FLUX.height}"}
    seen = set()
    with cf.ThreadPoolExecutor(24) as pool:
        burst = [pool.submit(requests.post, f"{server}/v1/images/generations", json={**body, "seed": i},
                             headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=120) for i in range(24)]
        while not all(f.done() for f in burst):
            seen.add(int(page.text_content(queued) or 0))
            time.sleep(0.1)
        assert all(f.result().status_code == 200 for f in burst)
    assert max(seen) > 0, f"the queue number never moved: {sorted(seen)}"
    until(page, f"document.querySelector(\"{queued}\").textContent === '0'", 10)
    # the answered requests count in the attainment column and the worker's memory is shown
    until(page, f"document.querySelector(\"table.plans tr[data-template='{FLUX.shape_key}']\")"
                           ".textContent.includes('% of')")
    assert page.query_selector(f"section.group[data-model='{FLUX.model}'] table.memory")
    p.only_own_host()
    p.close()


def test_playground_shows_references_and_adapters_where_the_api_offers_them(server: str, chrome: Any) -> None:
    """Feature detection from the OpenAPI document: this app has neither image edits nor adapters, so
    the test answers the page's calls for them as an app that has both would (``page.route``)."""
    p = Page(chrome, server)
    page = p.page
    page.goto(f"{server}/ui")
    p.set_key(USER_KEY)
    until(page, "document.querySelectorAll('#template option').length >= 1")
    assert page.is_hidden("#refs-box") and page.is_hidden("#adapters-box")  # this app offers neither

    doc = requests.get(f"{server}/openapi.json", timeout=30).json()
    doc["paths"]["/v1/images/edits"] = {"post": {"responses": {}}}
    doc["paths"]["/v1/adapters"] = {"get": {"responses": {}}}
    page.route("**/openapi.json", lambda route: route.fulfill(json=doc))
    page.route("**/v1/adapters", lambda route: route.fulfill(json={"data": [{"name": "style-a", "model": FLUX.model}]}))
    templates = requests.get(f"{server}/v1/templates", headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=30).json()
    plain = next(t for t in templates if t["template"] == FLUX.shape_key)
    edit = {**plain, "template": FLUX.shape_key + "/ref1@64x64", "references": 1, "reference_size": "64x64"}
    page.route("**/v1/templates", lambda route: route.fulfill(json=[*templates, edit]))
    page.reload()
    until(page, "document.querySelectorAll('#template option').length >= 1")
    page.select_option("#model", FLUX.model)
    page.select_option("#template", edit["template"])  # a template that takes a reference image
    assert page.is_visible("#refs-box") and page.is_visible("#adapters-box")
    page.select_option("#template", FLUX.shape_key)  # one that takes none: no box for it
    assert page.is_hidden("#refs-box") and page.is_visible("#adapters-box")
    page.check("#adapters input[data-name='style-a']")
    with page.expect_request("**/v1/images/generations") as sent:
        page.click("#submit")
    assert sent.value.post_data_json["lora"] == [{"name": "style-a", "scale": 1.0}]
    page.select_option("#model", COG.model)  # the adapter is Flux.2's; this app's videos take no reference
    assert page.is_hidden("#refs-box") and page.is_hidden("#adapters-box")
    p.only_own_host()
    p.close()
