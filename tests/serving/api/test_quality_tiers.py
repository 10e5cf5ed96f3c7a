"""Per-request ``quality`` through the real Router and in-process groups (``docs/quality.md``):
``lossless`` is the default and the same bytes as no ``quality``; ``fast`` runs the template's
priced step cache and says so in ``X-Xema-Quality``; a tier a template does not serve is a 422
naming ``quality`` and the served tiers; a request too short to skip a step runs lossless and the
headers say so; tiers never share a batch; ``/v1/stats`` counts the tiers served and
``/v1/templates`` lists each template's tiers with their predictions."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest

from bench.scenarios.factories import plan_entry
from planner.tiers import price_tiers
from tests.serving.api.router_harness import RouterHarness, running_router
from xema_ray.plan import PlanTable
from xema_ray.tier_plan import QualityTierSpec
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=6)
QWEN = RequestTemplate(model="tiny-qwen-image", width=64, height=64, steps=2)
LTX = RequestTemplate(model="tiny-ltx2", width=64, height=64, frames=9, steps=6)


@pytest.fixture(scope="module")
def served() -> Iterator[RouterHarness]:
    plans = {t.shape_key: plan_entry(t, batch=2, latency_s=0.5, slo_s=60.0) for t in (FLUX, QWEN, LTX)}
    # tiny-flux2 priced at the default tiers; tiny-qwen-image defines lossless only
    table = price_tiers(PlanTable(hardware="cpu:harness", gpus=1, budget_bytes=2**40, entries=plans),
                        {"tiny-qwen-image": {"lossless": QualityTierSpec()}})
    with running_router(dict(table.entries), wait_window_s=0.3) as h:
        yield h


def _image(h: RouterHarness, **fields: object) -> tuple[int, dict[str, str], dict]:
    body = {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64", "seed": 7, "response_format": "b64_json"}
    r = h.post("/v1/images/generations", {**body, **fields})
    return r.status, {k.lower(): v for k, v in r.headers.items()}, r.json()


def test_lossless_is_the_default_and_the_same_bytes_as_no_quality(served: RouterHarness) -> None:
    s1, h1, plain = _image(served)
    s2, h2, lossless = _image(served, quality="lossless")
    assert (s1, s2) == (200, 200)
    assert h1["x-xema-quality"] == h2["x-xema-quality"] == "lossless"
    assert plain["data"][0]["b64_json"] == lossless["data"][0]["b64_json"]


def test_fast_runs_the_step_cache_and_says_so(served: RouterHarness) -> None:
    s0, _, lossless = _image(served)
    s, headers, fast = _image(served, quality="fast")
    assert (s0, s) == (200, 200)
    assert headers["x-xema-quality"] == "fast" and "x-xema-quality-note" not in headers
    assert fast["data"][0]["b64_json"] != lossless["data"][0]["b64_json"]  # 6 steps, 1 reused: other bytes


def test_openai_low_asks_for_the_fastest_tier_served(served: RouterHarness) -> None:
    s, headers, _ = _image(served, quality="low")
    assert s == 200 and headers["x-xema-quality"] == "fast"


def test_a_request_too_short_to_skip_a_step_runs_lossless_and_says_so(served: RouterHarness) -> None:
    s, headers, _ = _image(served, quality="fast", num_inference_steps=3)
    assert s == 200 and headers["x-xema-quality"] == "lossless"
    assert "too few to skip" in headers["x-xema-quality-note"]


def test_error_raised_if_the_tier_is_not_served_for_the_template(served: RouterHarness) -> None:
    s, _, body = _image(served, model="tiny-qwen-image", quality="fast")
    assert s == 422
    err = body["error"]
    assert err["param"] == "quality" and "'fast'" in err["message"] and "serves: lossless" in err["message"]


def test_balanced_runs_quantized_weights_and_says_so(served: RouterHarness) -> None:
    """tiny-flux2 serves ``balanced`` (int8 weight-only on the CPU): the header names it, the
    image is another within the bound, and OpenAI's ``medium`` asks for it."""
    from tests.batch_sizes import mean_abs_difference

    s0, _, lossless = _image(served)
    s1, headers, balanced = _image(served, quality="balanced")
    s2, medium_headers, _ = _image(served, quality="medium")
    assert (s0, s1, s2) == (200, 200, 200)
    assert headers["x-xema-quality"] == medium_headers["x-xema-quality"] == "balanced"
    a, b = (base64.b64decode(x["data"][0]["b64_json"]) for x in (lossless, balanced))
    assert 0 < mean_abs_difference(a, b) <= 32.0


def test_balanced_is_refused_where_the_weights_are_not_quantizable(served: RouterHarness) -> None:
    """tiny-ltx2's spec names no quantizable weights: ``balanced`` by name is the 422, ``medium`` lossless."""
    body = {"model": "tiny-ltx2", "prompt": "a red fox", "size": "64x64", "num_frames": 9, "seed": 3}
    refused = served.post("/v1/videos/sync", {**body, "quality": "balanced"})
    assert refused.status == 422
    err = refused.json()["error"]
    assert err["param"] == "quality" and "'balanced'" in err["message"] and "serves: lossless, fast" in err["message"]
    s, _, _ = _image(served, model="tiny-qwen-image", quality="medium")
    assert s == 200


def test_auto_runs_lossless_on_an_idle_queue(served: RouterHarness) -> None:
    s, headers, _ = _image(served, quality="auto")
    assert s == 200 and headers["x-xema-quality"] == "lossless"


def test_tiers_never_share_a_batch(served: RouterHarness) -> None:
    base = {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64", "response_format": "b64_json"}
    answers = served.post_many("/v1/images/generations", [
        {**base, "seed": 1, "quality": "fast"}, {**base, "seed": 2}, {**base, "seed": 3, "quality": "fast"},
        {**base, "seed": 4}])
    assert all(a.status == 200 for a in answers)
    by_batch: dict[str, set[str]] = {}
    for a in answers:
        h = {k.lower(): v for k, v in a.headers.items()}
        by_batch.setdefault(h["x-xema-batch-id"], set()).add(h["x-xema-quality"])
    assert all(len(tiers) == 1 for tiers in by_batch.values()), by_batch


def test_stats_count_the_tiers_served_and_templates_list_them(served: RouterHarness) -> None:
    before = served.get("/v1/stats").json()["quality"]
    _image(served, quality="fast")
    after = served.get("/v1/stats").json()["quality"]
    assert after.get("fast", 0) == before.get("fast", 0) + 1
    info = {t["template"]: t for t in served.get("/v1/templates").json()}
    flux = [q["name"] for q in info[FLUX.shape_key]["quality_tiers"]]
    assert flux == ["lossless", "balanced", "fast"]
    tiers = {q["name"]: q for q in info[FLUX.shape_key]["quality_tiers"]}
    assert tiers["fast"]["predicted_latency_s"] < tiers["lossless"]["predicted_latency_s"]
    assert tiers["fast"]["predicted_peak_gb"] > tiers["lossless"]["predicted_peak_gb"]
    assert [q["name"] for q in info[QWEN.shape_key]["quality_tiers"]] == ["lossless"]


def test_videos_take_quality_too(served: RouterHarness) -> None:
    body = {"model": "tiny-ltx2", "prompt": "a red fox", "size": "64x64", "num_frames": 9, "seed": 3}
    fast, lossless = served.post("/v1/videos/sync", {**body, "quality": "fast"}), served.post("/v1/videos/sync", body)
    assert (fast.status, lossless.status) == (200, 200)
    assert {k.lower(): v for k, v in fast.headers.items()}["x-xema-quality"] == "fast"
    assert {k.lower(): v for k, v in lossless.headers.items()}["x-xema-quality"] == "lossless"
    assert fast.body != lossless.body
    bogus = served.post("/v1/videos/sync", {**body, "quality": "ultra"})
    assert bogus.status == 422 and bogus.json()["error"]["param"] == "quality"


def test_lora_runs_lossless_for_balanced_and_medium() -> None:
    """Adapters apply to the model's own weights: ``balanced`` by name with adapters runs lossless
    and the answer's note says why (a valid request, served: never a 422); OpenAI's ``medium`` (a
    hint) resolves to lossless as well."""
    from types import SimpleNamespace

    from xema_ray.serving.api.options import quality_note, resolve_options

    table = price_tiers(PlanTable(hardware="cpu:harness", gpus=1, budget_bytes=2**40,
                                  entries={FLUX.shape_key: plan_entry(FLUX, batch=1, latency_s=0.5, slo_s=60.0)}))
    lora = [SimpleNamespace(name="style", scale=1.0)]
    asked = SimpleNamespace(quality="balanced", lora=lora)
    assert resolve_options(FLUX, {FLUX.shape_key: FLUX}, asked, table).quality == "lossless"
    assert "served lossless" in quality_note(FLUX, asked, table)["X-Xema-Quality-Note"]
    assert quality_note(FLUX, SimpleNamespace(quality="balanced"), table) == {}
    assert resolve_options(FLUX, {FLUX.shape_key: FLUX}, SimpleNamespace(quality="balanced"), table).quality == "balanced"
    medium = resolve_options(FLUX, {FLUX.shape_key: FLUX}, SimpleNamespace(quality="medium", lora=lora), table)
    assert medium.quality == "lossless"
    plain = resolve_options(FLUX, {FLUX.shape_key: FLUX}, SimpleNamespace(quality="medium"), table)
    assert plain.quality == "balanced"
