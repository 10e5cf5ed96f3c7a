"""Image inputs in-process (ASGI, no Ray): ``/v1/images/edits`` and ``/v1/videos``' ``input_reference``
as the official client sends them (multipart, ``image`` / ``image[]``), the template each maps
to, and the bad-image matrix — every refusal a 4xx naming the field and the rule, and a refused
video create writes nothing to the job store."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image

from bench.scenarios.factories import plan_entry
from tests.serving.api.asgi_client import AsgiResponse, call
from xema_ray.plan import PlanTable
from xema_ray.serving.api.edits import ImageEditRequest, edit_inputs
from xema_ray.serving.api.errors import error_response, install_error_handlers
from xema_ray.serving.group.handle import GroupHandle
from xema_ray.serving.api.middleware import RequestGuard
from xema_ray.serving.api.openapi import build_openapi
from xema_ray.serving.api.schemas import RequestLimits, UnsupportedTemplate, set_limits
from xema_ray.serving.api.uploads import MAX_IMAGE_PIXELS
from xema_ray.serving.api.validation import parse_request
from xema_ray.serving.messages import GroupRequest
from xema_ray.serving.jobs.store import JobStoreConfig, open_store
from xema_ray.serving.api.video_jobs import ApiError, VideoJobs
from xema_ray.templates import RequestTemplate

SERVED = {t.shape_key: t for t in (
    RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4),
    RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4, references=1),
    RequestTemplate(model="tiny-flux2", width=64, height=64, steps=4, references=2),
    RequestTemplate(model="tiny-flux2", width=128, height=64, steps=4, references=1, reference_width=128,
                    reference_height=64),
    RequestTemplate(model="tiny-cogvideox-i2v", width=64, height=64, frames=9, steps=4, references=1),
    RequestTemplate(model="tiny-ltx2", width=64, height=64, frames=9, steps=4),
)}


def _png(w: int = 40, h: int = 30, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def _bomb(w: int = 10_000, h: int = 10_000) -> bytes:
    """A ``w`` x ``h`` PNG (100 MP by default) of a few kilobytes."""
    buf = io.BytesIO()
    Image.new("1", (w, h)).save(buf, format="PNG")
    return buf.getvalue()


def _multipart(fields: dict[str, str] | list[tuple[str, str]], files: list[tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = "xemaimageboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in (fields.items() if isinstance(fields, dict) else fields)]
    for i, (name, data) in enumerate(files):
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="f{i}.png"\r\n'
                     f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


class _Group:
    """A model group's handle: records what was submitted."""

    def __init__(self) -> None:
        self.got: list[GroupRequest] = []
        outer = self

        class _Remote:
            async def remote(self, req: GroupRequest) -> bool:
                outer.got.append(req)
                return True

        class _Estimate:
            async def remote(self, key: str) -> float:
                return 1.0

        self.submit_job = _Remote()
        self.estimate = _Estimate()


def _video_route(app: FastAPI, jobs: VideoJobs) -> None:
    """``POST /v1/videos`` as the Router answers it, on ``jobs``."""
    @app.post("/v1/videos")
    async def videos(request: Request) -> Any:
        try:
            return await jobs.create(request)
        except ApiError as e:
            return error_response(e.status, e.message, e.type, param=e.param, **e.extra)


@pytest.fixture
def api(tmp_path: Path) -> Any:
    set_limits(RequestLimits())
    cfg = JobStoreConfig(path=tmp_path / "jobs", ttl_s=600)
    group = _Group()
    table = PlanTable(hardware="test", gpus=1, budget_bytes=10**9,
                      entries={k: plan_entry(t) for k, t in SERVED.items()})
    jobs = VideoJobs(cfg, {"tiny-cogvideox-i2v": GroupHandle(group), "tiny-ltx2": GroupHandle(group)}, SERVED, table)
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuard)

    @app.post("/v1/images/edits")  # the Router's edit path, without the model group
    async def edits(request: Request) -> JSONResponse:
        uploads: list = []
        req = await parse_request(request, ImageEditRequest, uploads)
        try:
            t, refs = await edit_inputs(req, uploads, SERVED)
        except UnsupportedTemplate as e:  # as the Router answers it
            return error_response(400, str(e), param=e.param, code="unsupported_template",
                                  supported_templates=e.supported)
        return JSONResponse({"template": t.shape_key, "sizes": [Image.open(io.BytesIO(r)).size for r in refs]})

    _video_route(app, jobs)

    return app, open_store(cfg), group, cfg


def _post(app: FastAPI, path: str, fields: dict[str, str] | list[tuple[str, str]], files: list[tuple[str, bytes]],
          **kw: Any) -> AsgiResponse:
    body, ctype = _multipart(fields, files)
    return asyncio.run(call(app, "POST", path, body, headers={"content-type": ctype}, **kw))


EDIT = {"model": "tiny-flux2", "prompt": "a fox"}
VIDEO = {"model": "tiny-cogvideox-i2v", "prompt": "waves", "size": "64x64", "seconds": "1"}
PNG = _png()
TRUNCATED = {fmt: _png(64, 64, fmt=fmt)[: len(_png(64, 64, fmt=fmt)) // 2] for fmt in ("PNG", "JPEG", "WEBP")}

#: (endpoint fields, files, status, param, message fragment)
MATRIX: dict[str, tuple[str, dict[str, str], list[tuple[str, bytes]], int, str, str]] = {
    "edit: not an image": ("edits", EDIT, [("image", b"hello, not a picture")], 422, "image", "not an image"),
    "edit: truncated PNG": ("edits", EDIT, [("image", TRUNCATED["PNG"])], 422, "image", "truncated or corrupt"),
    "edit: truncated JPEG": ("edits", EDIT, [("image", TRUNCATED["JPEG"])], 422, "image", "truncated or corrupt"),
    "edit: truncated WebP": ("edits", EDIT, [("image", TRUNCATED["WEBP"])], 422, "image", "truncated or corrupt"),
    "edit: GIF": ("edits", EDIT, [("image", _png(fmt="GIF", mode="P"))], 422, "image", "GIF images are not accepted"),
    "edit: decompression bomb": ("edits", EDIT, [("image", _bomb())], 422, "image",
                                 f"100000000 pixels; an uploaded image may have at most {MAX_IMAGE_PIXELS}"),
    "edit: 42 MP image": ("edits", EDIT, [("image", _bomb(7000, 6000))], 422, "image",
                          f"7000x6000 is 42000000 pixels; an uploaded image may have at most {MAX_IMAGE_PIXELS}"),
    "edit: empty file": ("edits", EDIT, [("image", b"")], 422, "image", "the file is empty"),
    "edit: no image": ("edits", EDIT, [], 422, "image", "image: required"),
    "edit: more references than served": ("edits", EDIT, [("image[]", PNG)] * 3, 400, "image",
                                          "served with 1 or 2 reference image(s), got 3"),
    "edit: more references than the model takes": ("edits", EDIT, [("image[]", PNG)] * 11, 400, "image",
                                                    "the model takes at most 10"),
    "edit: a size the model cannot take": ("edits", {**EDIT, "size": "96x96"}, [("image", PNG)], 400, "size",
                                           "does not serve 96x96; served sizes: 128x64, 64x64"),
    "edit: bad image among good ones": ("edits", EDIT, [("image[]", PNG), ("image[]", b"GIF89a?")], 422, "image",
                                        "image[1]"),
    "video: not an image": ("videos", VIDEO, [("input_reference", b"\x00" * 64)], 422, "input_reference",
                            "not an image"),
    "video: truncated JPEG": ("videos", VIDEO, [("input_reference", TRUNCATED["JPEG"])], 422, "input_reference",
                              "truncated or corrupt"),
    "video: decompression bomb": ("videos", VIDEO, [("input_reference", _bomb())], 422, "input_reference",
                                  "pixels"),
    "video: two references": ("videos", VIDEO, [("input_reference", PNG)] * 2, 400, "input_reference",
                              "one image is taken, got 2"),
    "video: image-to-video model without an image": ("videos", VIDEO, [], 400, "input_reference",
                                                     "image-to-video model: send an input_reference"),
    "video: a size the model cannot take": ("videos", {**VIDEO, "size": "640x480"}, [("input_reference", PNG)], 400,
                                            "size", "does not serve a size near 640x480"),
    "video: a model not served with an image": ("videos", {**VIDEO, "model": "tiny-ltx2"},
                                                [("input_reference", PNG)], 400, "input_reference",
                                                "not served with an input_reference"),
}


def test_every_bad_image_is_a_4xx_naming_the_field_and_nothing_is_stored(api: Any) -> None:
    app, store, group, cfg = api
    seen = {}
    for case, (endpoint, fields, files, status, param, fragment) in MATRIX.items():
        r = _post(app, f"/v1/{'images/edits' if endpoint == 'edits' else 'videos'}", fields, files)
        err = r.json().get("error", {}) if r.body else {}
        seen[case] = (r.status, err.get("param"), err.get("message", ""))
        assert (r.status, err.get("param")) == (status, param), (case, r.status, r.body[:300])
        assert fragment in err["message"], (case, err["message"])
    # a 100 MB upload: refused from its declared length, before a byte is read (413 naming the field)
    for path, param in (("/v1/images/edits", "image"), ("/v1/videos", "input_reference")):
        body, ctype = _multipart(EDIT, [("image", PNG)])
        r = asyncio.run(call(app, "POST", path, body, content_length=False,
                             headers={"content-type": ctype, "content-length": str(100 * 2**20)}))
        assert r.status == 413 and r.json()["error"]["param"] == param, r.body
        assert "limits.max_body_bytes" in r.json()["error"]["message"]
    # a refused create leaves nothing behind: no job, no stored image, nothing submitted
    assert store.list()[0] == [] and group.got == []
    stored = [p for p in cfg.path.rglob("*") if p.is_file() and p.suffix in (".png", ".mp4", ".part")]
    assert stored == []
    print(json.dumps(seen, indent=1))  # the matrix, for the report (-s)


def test_an_edit_maps_to_the_template_of_its_count_and_size(api: Any) -> None:
    app = api[0]
    r = _post(app, "/v1/images/edits", EDIT, [("image", _png(300, 200))])
    # size 'auto': the served aspect nearest the image's (3:2 -> 128x64 rather than 64x64)
    assert r.status == 200 and r.json() == {"template": "tiny-flux2/128x64x1/ref1@128x64", "sizes": [[128, 64]]}
    r = _post(app, "/v1/images/edits", {**EDIT, "size": "64x64"}, [("image[]", _png(30, 90)), ("image[]", _png(90, 30))])
    assert r.json() == {"template": "tiny-flux2/64x64x1/ref2@64x64", "sizes": [[64, 64], [64, 64]]}


def test_a_video_job_carries_its_image_to_the_group(api: Any) -> None:
    app, store, group, _ = api
    r = _post(app, "/v1/videos", VIDEO, [("input_reference", _png(100, 50))])
    assert r.status == 200, r.body
    video = r.json()
    assert video["size"] == "64x64" and video["status"] == "queued"
    (req,) = group.got
    assert req.template == "tiny-cogvideox-i2v/64x64x9/ref1@64x64" and len(req.references) == 1
    assert Image.open(io.BytesIO(req.references[0])).size == (64, 64)
    assert store.get(video["id"]).references == 1
    # JSON stays accepted: the image as a data URL
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    r = asyncio.run(call(app, "POST", "/v1/videos", json.dumps({**VIDEO, "input_reference": url}).encode()))
    assert r.status == 200 and len(group.got) == 2 and group.got[1].references


def test_an_orphaned_job_whose_image_is_gone_fails_once_instead_of_waiting_for_its_ttl(tmp_path: Path) -> None:
    """Re-dispatching a job needs its stored first frame: gone (expired, deleted), the job fails
    with the reason at the next reconcile rather than staying queued, retried, until its TTL."""
    set_limits(RequestLimits())
    cfg = JobStoreConfig(path=tmp_path / "jobs", ttl_s=600, lease_s=0.01)
    group = _Group()
    table = PlanTable(hardware="test", gpus=1, budget_bytes=10**9, entries={k: plan_entry(t) for k, t in SERVED.items()})
    jobs = VideoJobs(cfg, {"tiny-cogvideox-i2v": GroupHandle(group)}, SERVED, table)
    app = FastAPI()

    @app.post("/v1/videos")
    async def videos(request: Request) -> Any:
        return await jobs.create(request)

    r = _post(app, "/v1/videos", VIDEO, [("input_reference", PNG)])
    assert r.status == 200, r.body
    job, store = r.json()["id"], open_store(cfg)
    store.delete_files_of(job)  # its image expired; nobody runs the job (the fake group never takes it)
    time.sleep(0.05)
    assert asyncio.run(jobs.reconcile()) == 0
    rec = store.get(job)
    assert rec.status == "failed" and rec.error_code == "invalid_request" and "reference image 0 is missing" in rec.error_message


def test_a_video_job_carries_its_adapters_to_the_group_and_keeps_them_in_its_record(api: Any) -> None:
    """``lora`` on a video job (a JSON body): stored with the job, so a re-dispatch runs with it too."""
    app, store, group, _ = api
    body = {"model": "tiny-ltx2", "prompt": "waves", "size": "64x64", "num_frames": 9,
            "lora": [{"name": "style-a", "scale": 0.5}, {"name": "character"}]}
    r = asyncio.run(call(app, "POST", "/v1/videos", json.dumps(body).encode()))
    assert r.status == 200, r.body
    (req,) = group.got
    assert [(u.name, u.scale) for u in req.lora] == [("style-a", 0.5), ("character", 1.0)]
    assert store.get(r.json()["id"]).lora == req.lora
    bad = asyncio.run(call(app, "POST", "/v1/videos", json.dumps({**body, "lora": [{"name": "../etc"}]}).encode()))
    assert bad.status == 422 and "lora" in bad.body.decode() and len(group.got) == 1


def test_a_multipart_video_job_takes_lora_as_the_openai_client_sends_it(api: Any) -> None:
    """``videos.create(input_reference=file, extra_body={"lora": [...]})`` is multipart: the client
    writes the list as ``lora[][name]`` / ``lora[][scale]`` fields; ``lora`` as JSON text works too
    (curl -F). Both reach the group with the job's adapters; a malformed one is a 422 naming it."""
    app, store, group, _ = api
    fields = [*VIDEO.items(), ("lora[][name]", "style-a"), ("lora[][scale]", "0.5"), ("lora[][name]", "character")]
    r = _post(app, "/v1/videos", fields, [("input_reference", PNG)])
    assert r.status == 200, r.body
    (req,) = group.got
    assert [(u.name, u.scale) for u in req.lora] == [("style-a", 0.5), ("character", 1.0)]
    assert store.get(r.json()["id"]).lora == req.lora
    r = _post(app, "/v1/videos", {**VIDEO, "lora": '[{"name": "style-a", "scale": -1}]'}, [("input_reference", PNG)])
    assert r.status == 200, r.body
    assert [(u.name, u.scale) for u in group.got[-1].lora] == [("style-a", -1.0)]
    repeated = [*VIDEO.items(), ("lora", '{"name": "style-a"}'), ("lora", '{"name": "character", "scale": 2}')]
    r = _post(app, "/v1/videos", repeated, [("input_reference", PNG)])  # one JSON object per field
    assert r.status == 200, r.body
    assert [(u.name, u.scale) for u in group.got[-1].lora] == [("style-a", 1.0), ("character", 2.0)]
    both = [*VIDEO.items(), ("lora", '["x"]'), ("lora[][name]", "style-a")]  # JSON and fields at once
    for bad, param in (({**VIDEO, "lora": "style-a"}, "lora"), ({**VIDEO, "lora[][scale]": "9"}, "lora"),
                       (both, "lora")):
        r = _post(app, "/v1/videos", bad, [("input_reference", PNG)])
        assert r.status == 422 and r.json()["error"]["param"].startswith(param), r.body
    assert len(group.got) == 3


def test_openapi_documents_the_uploads() -> None:
    from xema_ray.serving.api.router import app as router_app

    doc = build_openapi(router_app, SERVED, RequestLimits())
    edits = doc["paths"]["/v1/images/edits"]["post"]
    schemas = doc["components"]["schemas"]
    form = edits["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form == {"$ref": "#/components/schemas/ImageEditRequestForm"}
    assert schemas["ImageEditRequestForm"]["properties"]["image"]["items"]["format"] == "binary"
    assert "image" in schemas["ImageEditRequestForm"]["required"]
    props = schemas["ImageEditRequest"]["properties"]
    assert props["size"]["enum"] == ["128x64", "64x64", "auto"] and props["model"]["enum"] == ["tiny-flux2"]
    video_form = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert video_form == {"$ref": "#/components/schemas/VideoCreateForm"}
    assert schemas["VideoCreateForm"]["properties"]["input_reference"]["format"] == "binary"
    assert {"400", "413", "422"} <= set(edits["responses"])


WAN = {t.shape_key: t for t in (
    RequestTemplate(model="tiny-wan2.2-i2v", width=64, height=64, frames=9, steps=4, references=1),
    RequestTemplate(model="tiny-wan2.2-ti2v", width=64, height=64, frames=9, steps=4),
    RequestTemplate(model="tiny-wan2.2-ti2v", width=64, height=64, frames=9, steps=4, references=1),
)}


def test_wan_first_frames_map_to_their_templates_and_i2v_refuses_text_only(tmp_path: Path) -> None:
    """Wan2.2-I2V is image-to-video only: ``input_reference`` is accepted, a text-only create is a
    400 naming it (nothing stored); TI2V-5B takes one or none, each to its own template."""
    set_limits(RequestLimits())
    cfg = JobStoreConfig(path=tmp_path / "jobs", ttl_s=600)
    group = _Group()
    table = PlanTable(hardware="test", gpus=1, budget_bytes=10**9, entries={k: plan_entry(t) for k, t in WAN.items()})
    jobs = VideoJobs(cfg, {"tiny-wan2.2-i2v": GroupHandle(group), "tiny-wan2.2-ti2v": GroupHandle(group)}, WAN, table)
    app = FastAPI()

    _video_route(app, jobs)

    i2v = {"model": "tiny-wan2.2-i2v", "prompt": "waves", "size": "64x64", "seconds": "0.5"}  # 9 frames at 16 fps
    r = _post(app, "/v1/videos", i2v, [])
    assert r.status == 400 and r.json()["error"]["param"] == "input_reference", r.body
    assert "image-to-video model: send an input_reference" in r.json()["error"]["message"]
    assert open_store(cfg).list()[0] == [] and group.got == []
    r = _post(app, "/v1/videos", i2v, [("input_reference", _png(96, 80))])
    assert r.status == 200 and r.json()["size"] == "64x64", r.body
    ti2v = {**i2v, "model": "tiny-wan2.2-ti2v", "seconds": "0.33"}  # 9 frames at 24 fps
    assert _post(app, "/v1/videos", ti2v, [("input_reference", PNG)]).status == 200
    assert _post(app, "/v1/videos", ti2v, []).status == 200
    assert [g.template for g in group.got] == ["tiny-wan2.2-i2v/64x64x9/ref1@64x64", "tiny-wan2.2-ti2v/64x64x9/ref1@64x64",
                                               "tiny-wan2.2-ti2v/64x64x9"]
    assert [len(g.references) for g in group.got] == [1, 1, 0]
