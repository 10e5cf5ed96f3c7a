"""``guidance_scale_2``: the low-noise expert's guidance of a two-expert model (Wan2.2 A14B,
tiny-wan2.2), defaulting to the request's ``guidance_scale`` as diffusers' ``WanPipeline`` does;
out of range a 422, on a model of one expert a 400 naming the models that take it; listed in
``/v1/templates`` and the OpenAPI document. The real Router in front of in-process groups."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from bench.scenarios.factories import plan_entry
from tests.serving.api.router_harness import RouterHarness, running_router
from xema_ray.models import get_model_spec
from xema_ray.models.options import OptionRefused
from xema_ray.serving.api.options import resolve_options
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.slow

WAN = RequestTemplate(model="tiny-wan2.2", width=64, height=64, frames=9, steps=4)
LTX = RequestTemplate(model="tiny-ltx2", width=64, height=64, frames=9, steps=2)
SYNC = "/v1/videos/sync"
WAN_BODY = {"model": "tiny-wan2.2", "prompt": "a red fox", "size": "64x64", "num_frames": 9, "seed": 3}


def test_only_two_expert_models_take_it_and_it_defaults_to_guidance_scale() -> None:
    takes = {m: get_model_spec(m).option_rules().guidance_scale_2
             for m in ("tiny-wan2.2", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b", "tiny-ltx2", "tiny-flux2")}
    assert takes == {"tiny-wan2.2": True, "wan2.2-t2v-a14b": True, "wan2.2-i2v-a14b": True, "wan2.2-ti2v-5b": False,
                     "tiny-ltx2": False, "tiny-flux2": False}
    spec = WAN.spec
    assert spec.call_kwargs(WAN)["guidance_scale_2"] == 3.0  # the Wan team's pair: 4.0 then 3.0
    assert spec.call_kwargs(WAN, 5.0)["guidance_scale_2"] == 5.0  # diffusers: guidance_scale_2 = guidance_scale
    served = {WAN.shape_key: WAN, LTX.shape_key: LTX}
    assert resolve_options(WAN, served, SimpleNamespace(guidance_scale_2=1.5)).guidance_scale_2 == 1.5
    with pytest.raises(OptionRefused, match="tiny-ltx2 does not take guidance_scale_2; served models that do: "
                                            "tiny-wan2.2") as e:
        resolve_options(LTX, served, SimpleNamespace(guidance_scale_2=1.5))
    assert (e.value.status, e.value.param) == (400, "guidance_scale_2")
    with pytest.raises(OptionRefused, match=r"accepted \[0, 50\]") as e:
        resolve_options(WAN, served, SimpleNamespace(guidance_scale_2=51.0))
    assert (e.value.status, e.value.param) == (422, "guidance_scale_2")


def test_the_default_guidance_named_explicitly_gets_the_default_batch_key() -> None:
    """A request naming the model's default guidance joins the batches of those naming none; on a
    two-expert model ``guidance_scale`` alone also sets the low-noise expert's (diffusers), so the
    default's value is the default's key only where the second expert's is the default's too."""
    served = {WAN.shape_key: WAN, LTX.shape_key: LTX}

    def key(t: RequestTemplate, **given: float) -> tuple[float | None, float | None]:
        o = resolve_options(t, served, SimpleNamespace(**given))
        return o.guidance_scale, o.guidance_scale_2

    ltx_default = LTX.spec.default_guidance_scale
    assert key(LTX) == key(LTX, guidance_scale=ltx_default) == (None, None)
    assert key(LTX, guidance_scale=ltx_default + 1.0) == (ltx_default + 1.0, None)
    assert key(WAN, guidance_scale=4.0, guidance_scale_2=3.0) == key(WAN, guidance_scale_2=3.0) == (None, None)
    assert key(WAN, guidance_scale=4.0) == (4.0, None)  # runs the low-noise expert at 4.0, not the default 3.0
    assert key(WAN, guidance_scale_2=1.5) == (None, 1.5)


@pytest.fixture(scope="module")
def served() -> Iterator[RouterHarness]:
    plans = {WAN.shape_key: plan_entry(WAN, batch=2, latency_s=2.0, slo_s=60.0),
             LTX.shape_key: plan_entry(LTX, batch=2, latency_s=2.0, slo_s=60.0)}
    with running_router(plans, wait_window_s=0.1) as h:
        yield h


def test_guidance_scale_2_is_served_and_documented(served: RouterHarness) -> None:
    infos = {t["model"]: t for t in served.get("/v1/templates").json()}
    assert "guidance_scale_2" in infos["tiny-wan2.2"]["options"]
    assert "guidance_scale_2" not in infos["tiny-ltx2"]["options"]
    doc = json.loads(served.get("/openapi.json").body)
    video = doc["components"]["schemas"]["VideoRequest"]
    assert video["x-model-options"]["tiny-wan2.2"]["guidance_scale_2"] is True
    assert video["x-model-options"]["tiny-ltx2"]["guidance_scale_2"] is False

    plain, low, low_again = (served.post(SYNC, b) for b in (WAN_BODY, {**WAN_BODY, "guidance_scale_2": 1.5},
                                                            {**WAN_BODY, "guidance_scale_2": 1.5}))
    assert plain.status == low.status == low_again.status == 200, (plain.body[:300], low.body[:300])
    assert low.body == low_again.body and low.body != plain.body  # the request's own, bit for bit
    # not given, it is the request's guidance_scale (diffusers' default)
    one, both = (served.post(SYNC, b) for b in ({**WAN_BODY, "guidance_scale": 2.0},
                                                {**WAN_BODY, "guidance_scale": 2.0, "guidance_scale_2": 2.0}))
    assert one.status == both.status == 200 and one.body == both.body

    r = served.post(SYNC, {"model": "tiny-ltx2", "prompt": "a fox", "size": "64x64", "num_frames": 9,
                           "guidance_scale_2": 1.5})
    assert r.status == 400, r.body[:300]
    err = r.json()["error"]
    assert err["param"] == "guidance_scale_2" and "tiny-wan2.2" in err["message"]
    r = served.post(SYNC, {**WAN_BODY, "guidance_scale_2": 60.0})
    assert r.status == 422 and r.json()["error"]["param"] == "guidance_scale_2", r.body[:300]
