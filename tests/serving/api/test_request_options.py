"""The request options peers' clients send (``negative_prompt``, ``true_cfg_scale``,
``num_inference_steps``, ``guidance_scale``) through the real Router in front of in-process model
groups (no Ray): ranges each model's pipeline enforces are refused before admission (4xx naming
the field and the range), and a request that still fails inside a batch for its own input fails
alone while its batch neighbours are served — named by the worker, or found by running the batch
again split (a fault planted inside denoising)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from bench.scenarios.factories import plan_entry
from tests.serving.api.router_harness import RouterHarness, running_router
from xema_ray.models import get_model_spec
from xema_ray.models.options import OptionRefused
from xema_ray.serving.jobs.store import JobStoreConfig
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.slow

LTX = RequestTemplate(model="tiny-ltx2", width=64, height=64, frames=9, steps=2)
FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
QWEN = RequestTemplate(model="tiny-qwen-image", width=64, height=64, steps=2)
FLUX_EDIT = FLUX.with_(references=1, reference_width=64, reference_height=64)  # /v1/images/edits, fuzzed too
SYNC = "/v1/videos/sync"
IMAGES = "/v1/images/generations"
LTX_BODY = {"model": "tiny-ltx2", "prompt": "a red fox", "size": "64x64", "num_frames": 9}
FLUX_BODY = {"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64"}
POISON = "POISON: this prompt cannot be encoded"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    """tiny-ltx2 planned at batch 6, tiny-flux2 at batch 4, tiny-qwen-image at 2: concurrent
    requests share one batch (wait window 0.5 s)."""
    plans = {LTX.shape_key: plan_entry(LTX, batch=6, latency_s=2.0, slo_s=60.0),
             FLUX.shape_key: plan_entry(FLUX, batch=4, latency_s=0.5, slo_s=60.0),
             QWEN.shape_key: plan_entry(QWEN, batch=2, latency_s=0.5, slo_s=60.0),
             FLUX_EDIT.shape_key: plan_entry(FLUX_EDIT, batch=2, latency_s=0.5, slo_s=60.0)}
    with running_router(plans, wait_window_s=0.5, jobs=JobStoreConfig(path=str(tmp_path_factory.mktemp("jobs")))) as h:
        yield h


def _error(r, status: int, param: str) -> str:  # type: ignore[no-untyped-def]
    assert r.status == status, r.body[:400]
    err = r.json()["error"]
    assert err["param"] == param, err
    return str(err["message"])


def test_ltx2_guidance_below_one_is_refused_with_the_models_range() -> None:
    with pytest.raises(OptionRefused, match=r"accepted \[1, 50\]") as e:
        get_model_spec("tiny-ltx2").option_rules().check("tiny-ltx2", guidance_scale=0.0)
    assert e.value.status == 422 and e.value.param == "guidance_scale"
    get_model_spec("tiny-ltx2").option_rules().check("tiny-ltx2", guidance_scale=1.0)


def test_which_models_take_a_negative_prompt_and_true_cfg() -> None:
    takes = {m: (get_model_spec(m).option_rules().negative_prompt, get_model_spec(m).option_rules().true_cfg_scale)
             for m in ("tiny-flux2", "tiny-cogvideox", "tiny-ltx2", "tiny-wan2.2", "tiny-qwen-image")}
    assert takes == {"tiny-flux2": (False, False), "tiny-cogvideox": (True, False), "tiny-ltx2": (True, False),
                     "tiny-wan2.2": (True, False), "tiny-qwen-image": (True, True)}


def test_six_requests_one_with_guidance_zero_five_served(served: RouterHarness) -> None:
    """The report's case: guidance 0.0 on tiny-ltx2 with five valid neighbours (guidance 3.0)."""
    bodies = [{**LTX_BODY, "seed": i, "guidance_scale": 0.0 if i == 2 else 3.0} for i in range(6)]
    rs = served.post_many(SYNC, bodies)
    assert [r.status for r in rs] == [200, 200, 422, 200, 200, 200], [r.body[:200] for r in rs]
    assert "accepted [1, 50]" in _error(rs[2], 422, "guidance_scale")
    assert all(r.headers["content-type"] == "video/mp4" for i, r in enumerate(rs) if i != 2)
    assert len({r.headers["x-xema-batch-id"] for i, r in enumerate(rs) if i != 2}) == 1  # one batch of five


def test_a_request_failing_inside_its_batch_fails_alone(served: RouterHarness,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An input the API cannot catch (a prompt the stand-in encoder raises on, planted here): the
    worker pins the failure on its request, the group re-runs the other three and serves them."""
    spec = get_model_spec("tiny-flux2")
    original = type(spec).prompt_embeddings

    def planted(self, prompts, device, dtype):  # type: ignore[no-untyped-def]
        if POISON in prompts:
            raise RuntimeError("planted encoder fault")
        return original(self, prompts, device, dtype)

    monkeypatch.setattr(type(spec), "prompt_embeddings", planted)
    bodies = [{**FLUX_BODY, "seed": i, "prompt": POISON if i == 1 else f"fox {i}"} for i in range(4)]
    rs = served.post_many(IMAGES, bodies)
    assert [r.status for r in rs] == [200, 422, 200, 200], [r.body[:200] for r in rs]
    assert "planted encoder fault" in _error(rs[1], 422, "prompt")
    served_ok = [r for i, r in enumerate(rs) if i != 1]
    assert {r.headers["x-xema-batch-size"] for r in served_ok} == {"3"}  # re-run without it
    assert len({r.headers["x-xema-batch-id"] for r in served_ok}) == 1


def test_a_request_failing_inside_denoising_with_nothing_named_fails_alone(served: RouterHarness,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An input the API cannot catch and the worker cannot name: a fault planted inside the
    denoising loop raises (``ValueError``) for any batch holding the poisoned prompt. The group runs
    the batch again split until the poisoned request fails alone: it gets a 422 quoting the error,
    its three neighbours are served."""
    from tests.serving.planted_fault import planted_denoise_fault

    with planted_denoise_fault(monkeypatch, lambda prompts: POISON in prompts,
                               lambda: ValueError("planted: this prompt's latents cannot be denoised")) as fault:
        bodies = [{**FLUX_BODY, "seed": 20 + i, "prompt": POISON if i == 3 else f"fox {i}"} for i in range(4)]
        rs = served.post_many(IMAGES, bodies)
    assert [r.status for r in rs] == [200, 200, 200, 422], [r.body[:200] for r in rs]
    msg = rs[3].json()["error"]["message"]
    assert "failed inside its batch and again alone" in msg and "planted: this prompt's latents" in msg
    assert len({r.headers["x-xema-batch-id"] for r in rs[:3]}) == 1  # one batch, run again without it
    assert sorted(fault.failed[0]) == sorted(["fox 0", "fox 1", "fox 2", POISON]) and fault.failed[-1] == [POISON]
    assert sum(POISON in b for b in fault.batches) == len(fault.failed)  # every batch holding it failed, no other


def test_peer_benchmark_payload_is_served_where_the_model_takes_it(served: RouterHarness) -> None:
    """A peer benchmark client's payload: n, size, response_format, num_inference_steps 8 and 50,
    negative_prompt, true_cfg_scale."""
    peer = {"model": "tiny-qwen-image", "prompt": "a lighthouse at dusk", "n": 1, "size": "64x64",
            "response_format": "b64_json", "negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0}
    for steps in (8, 50):
        r = served.post(IMAGES, {**peer, "num_inference_steps": steps, "seed": 7})
        assert r.status == 200, r.body[:300]
        assert len(r.json()["data"]) == 1
    # Flux.2 runs no CFG pass: a negative prompt / true CFG is a 400 naming the models that take them
    msg = _error(served.post(IMAGES, {**FLUX_BODY, "negative_prompt": "blurry"}), 400, "negative_prompt")
    assert "tiny-ltx2" in msg and "tiny-qwen-image" in msg
    msg = _error(served.post(IMAGES, {**FLUX_BODY, "true_cfg_scale": 4.0}), 400, "true_cfg_scale")
    assert "tiny-qwen-image" in msg and "tiny-ltx2" not in msg
    assert served.post(IMAGES, {**FLUX_BODY, "num_inference_steps": 8}).status == 200
    _error(served.post(IMAGES, {**FLUX_BODY, "num_inference_steps": 201}), 422, "num_inference_steps")
    assert served.post(SYNC, {**LTX_BODY, "negative_prompt": "static, blurry", "num_inference_steps": 3}).status == 200


def test_a_negative_prompt_changes_the_output_and_steps_run_as_asked(served: RouterHarness) -> None:
    base = {**LTX_BODY, "seed": 11}
    plain, neg, again = (served.post(SYNC, b) for b in (base, {**base, "negative_prompt": "rain"},
                                                        {**base, "negative_prompt": "rain"}))
    assert plain.status == neg.status == again.status == 200
    assert neg.body == again.body and neg.body != plain.body  # the negative prompt is the request's own


def test_templates_and_openapi_document_each_models_options(served: RouterHarness) -> None:
    infos = {t["model"]: t for t in served.get("/v1/templates").json()}
    assert infos["tiny-ltx2"]["steps_range"] == [1, 200]
    assert "guidance_scale in [1, 50]" in infos["tiny-ltx2"]["options"]
    assert "true_cfg_scale" in infos["tiny-qwen-image"]["options"]
    r = served.get("/openapi.json")
    assert r.status == 200, r.body[:300]
    doc = json.loads(r.body)
    video = doc["components"]["schemas"]["VideoRequest"]
    assert video["x-model-options"]["tiny-ltx2"]["guidance_scale"] == {"minimum": 1.0, "maximum": 50.0}
    assert "tiny-ltx2" in video["properties"]["guidance_scale"]["description"]
    image = doc["components"]["schemas"]["ImageRequest"]
    assert image["x-model-options"]["tiny-flux2"]["negative_prompt"] is False


#: the fuzz's step counts are capped here (not in the document) so that the valid cases it builds
#: run in seconds on 2 CPUs; the live run (BENCHMARKS.md) fuzzes the document's full range
FUZZ_MAX_STEPS = 4


def test_fuzz_every_operation_finds_no_server_error(served: RouterHarness) -> None:
    """schemathesis over the whole OpenAPI document, every operation, positive and negative cases,
    a real job id supplied for the job operations' ``video_id`` in every other case."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance

    base = served.serve_http()
    job = served.post("/v1/videos", {"model": "tiny-ltx2", "prompt": "a fox", "size": "64x64"})
    assert job.status == 200, job.body[:300]
    job_id = job.json()["id"]
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    counts = {"cases": 0, "server_errors": 0}
    called: set[str] = set()
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 12
    for op in ops:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.NEGATIVE and op.method.lower() != "post":
                continue  # a GET's only inputs (ids, enums, a bounded limit) have no invalid form left to generate

            @settings(max_examples=5, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:  # type: ignore[no-untyped-def]
                if case.path_parameters and "video_id" in case.path_parameters and counts["cases"] % 2 == 0:
                    case.path_parameters["video_id"] = job_id
                if isinstance(case.body, dict) and isinstance(case.body.get("num_inference_steps"), int):
                    case.body["num_inference_steps"] = min(case.body["num_inference_steps"], FUZZ_MAX_STEPS)
                response = case.call(base_url=base, timeout=120)
                counts["cases"] += 1
                called.add(op.label)
                counts["server_errors"] += response.status_code >= 500 and response.status_code != 503
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

            fuzz()
    print(f"\nschemathesis in-process: {len(ops)} operations, {counts}")
    assert counts["server_errors"] == 0 and called == {op.label for op in ops}


@pytest.mark.parametrize("model", ["tiny-cogvideox", "tiny-ltx2", "tiny-wan2.2", "tiny-qwen-image"])
def test_cfg_models_are_traced_with_their_negative_prompt_rows(model: str) -> None:
    """What the analyzer traces and the plan reserves already holds a negative prompt's rows for
    every model that takes one: a client's negative prompt changes values, never shapes."""
    import torch

    spec = get_model_spec(model)
    inputs = spec.prompt_embeddings(["a fox", "a cat"], "meta", torch.bfloat16)
    negatives = {k: v for k, v in inputs.items() if k.startswith("negative_")}
    assert negatives and all(v.shape == inputs[k.removeprefix("negative_")].shape for k, v in negatives.items())
    passes = spec.transformer_passes_per_step()
    assert passes[0] >= 2 or len(passes) >= 2  # CFG traced: a doubled batch, or a second call per step


def test_video_jobs_take_the_options_and_refuse_out_of_range_ones_storing_nothing(served: RouterHarness) -> None:
    import time

    before = served.get("/v1/videos").json()["data"]
    refused = served.post("/v1/videos", {"model": "tiny-ltx2", "prompt": "a fox", "guidance_scale": 0.5})
    assert "accepted [1, 50]" in _error(refused, 422, "guidance_scale")
    assert served.get("/v1/videos").json()["data"] == before  # a refused create stores nothing
    job = served.post("/v1/videos", {"model": "tiny-ltx2", "prompt": "a fox", "num_inference_steps": 3,
                                     "negative_prompt": "rain"})
    assert job.status == 200, job.body[:300]
    deadline = time.monotonic() + 120
    while (v := served.get(f"/v1/videos/{job.json()['id']}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, v
        time.sleep(0.2)
    assert v["status"] == "completed", v


def test_qwen_guidance_and_true_cfg_are_one_scale() -> None:
    from types import SimpleNamespace

    from xema_ray.serving.api.options import resolve_options

    served = {t.shape_key: t for t in (QWEN, FLUX)}

    def req(**kw):  # type: ignore[no-untyped-def]
        return SimpleNamespace(**{"guidance_scale": None, "negative_prompt": None, "true_cfg_scale": None,
                                  "num_inference_steps": None, **kw})
    assert resolve_options(QWEN, served, req(true_cfg_scale=5.0)).guidance_scale == 5.0
    assert resolve_options(QWEN, served, req(guidance_scale=5.0, true_cfg_scale=5.0)).guidance_scale == 5.0
    default = QWEN.spec.default_guidance_scale  # named, it is the default's batch key: none
    assert resolve_options(QWEN, served, req(true_cfg_scale=default)).guidance_scale is None
    with pytest.raises(OptionRefused, match="same scale") as e:
        resolve_options(QWEN, served, req(guidance_scale=3.0, true_cfg_scale=4.0))
    assert e.value.param == "true_cfg_scale"
    assert resolve_options(QWEN, served, req(num_inference_steps=QWEN.steps)).steps == QWEN.steps
    # not given: resolved here, once, to the template's own count (every layer below carries the int)
    assert resolve_options(QWEN, served, req()).steps == QWEN.steps
    assert resolve_options(QWEN, served, req(num_inference_steps=5)).steps == 5


def test_an_edit_through_the_real_router_takes_the_options_and_a_bad_image_fails_alone(served: RouterHarness) -> None:
    """``/v1/images/edits`` on the Router itself: two edits and a truncated image at once; the
    good ones are served (with a negative-prompt-free model's steps option), the bad one is a 422."""
    import io

    from PIL import Image

    from tests.serving.api.asgi_client import call

    def form(image: bytes, **fields: str) -> tuple[bytes, dict[str, str]]:
        parts = [f'--b\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                 for k, v in {"model": "tiny-flux2", "prompt": "the fox", "seed": "3", **fields}.items()]
        parts.append(b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
                     b"Content-Type: image/png\r\n\r\n" + image + b"\r\n--b--\r\n")
        return b"".join(parts), {"content-type": "multipart/form-data; boundary=b"}

    buf = io.BytesIO()
    Image.new("RGB", (80, 60), (200, 30, 30)).save(buf, format="PNG")
    good = buf.getvalue()

    async def three() -> list:
        import asyncio

        bodies = [form(good), form(good, num_inference_steps="3"), form(good[:60])]
        return list(await asyncio.gather(*(call(served.app, "POST", "/v1/images/edits", b, headers=h)
                                           for b, h in bodies)))
    ok, ok_steps, bad = served.run(three())
    assert ok.status == 200 and ok_steps.status == 200, (ok.body[:300], ok_steps.body[:300])
    assert ok.headers["x-xema-template"] == FLUX_EDIT.shape_key and ok.json()["size"] == "64x64"
    assert ok.json()["data"][0]["b64_json"] != ok_steps.json()["data"][0]["b64_json"]  # 3 steps, not 2
    assert _error(bad, 422, "image").startswith("image ('a.png'): the PNG file is truncated")
