"""The HTTP ingress (Ray Serve + FastAPI): OpenAI-style endpoints, template mapping, errors.

Status codes: 422 malformed input (FastAPI names the field), 400 a well-formed request for a
template this deployment does not serve (with the list it does serve), 503 with Retry-After when
a template's queue is full or its worker set is down, 500 only for bugs.
"""

# no `from __future__ import annotations`: FastAPI must see the request models as real classes

import asyncio
import base64
import itertools
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayTaskError

from xema_ray.plan import PlanTable
from xema_ray.serving.api import (
    ImageData,
    ImageRequest,
    ImageResponse,
    TemplateInfo,
    UnsupportedTemplate,
    VideoRequest,
    match_template,
    parse_size,
)
from xema_ray.serving.model_group import GroupUnavailable, QueueFull
from xema_ray.templates import RequestTemplate

app = FastAPI(title="Xema-Ray", description="Diffusion serving with trace-guided memory mitigation and planned execution")


def _cause(e: BaseException) -> BaseException:
    """The exception a replica raised (Ray wraps it in RayTaskError)."""
    if isinstance(e, RayTaskError) and e.cause is not None:
        return e.cause
    return e


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    headers = {}
    if "retry_after_s" in extra:
        headers["Retry-After"] = str(int(round(extra.pop("retry_after_s"))))
    return JSONResponse(status_code=status, content={"error": {"message": message, **extra}}, headers=headers)


def _where(t: RequestTemplate, out: dict[str, Any]) -> dict[str, str]:
    """Response headers saying how the request ran: template, batch and the workers of its group."""
    return {"X-Xema-Template": t.shape_key, "X-Xema-Batch-Id": str(out["batch_id"]),
            "X-Xema-Batch-Size": str(out["batch_size"]), "X-Xema-Workers": ",".join(map(str, out["workers"])),
            "X-Xema-Batch-Seconds": f"{out['batch_seconds']:.4f}"}


@serve.ingress(app)
class Router:
    """Maps requests to templates, looks up the plan, forwards to the model's group."""

    def __init__(self, groups: dict[str, Any], table_json: str, templates: list[str]) -> None:
        self.groups = groups
        self.table = PlanTable.model_validate_json(table_json)
        self.served: dict[str, RequestTemplate] = {}
        for raw in templates:
            t = RequestTemplate.model_validate_json(raw)
            self.served[t.shape_key] = t
        self._ids = itertools.count()
        self.received = 0  # generation requests that reached the server: the load test's arrival count

    def _request_id(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def _template(self, model: str, size: str, frames: int, steps: int | None, kind: str) -> RequestTemplate:
        width, height = parse_size(size)
        t = match_template(model, width, height, frames, self.served, kind)  # type: ignore[arg-type]
        if steps is not None and steps != t.steps:
            raise UnsupportedTemplate(
                f"{t.shape_key} is served with {t.steps} denoising steps, got num_inference_steps={steps}",
                sorted(self.served))
        return t

    async def _generate(self, t: RequestTemplate, prompt: str, seed: int | None, guidance: float | None) -> dict[str, Any]:
        handle = self.groups[t.model]
        seed = seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        return await handle.generate.remote(t.shape_key, self._request_id(), prompt, seed, guidance)

    async def _guarded(self, coro) -> Any:  # type: ignore[no-untyped-def]
        try:
            return await coro
        except Exception as e:  # translate the replica's error into an HTTP status
            cause = _cause(e)
            if isinstance(cause, UnsupportedTemplate):
                return _error(400, str(cause), supported_templates=cause.supported)
            if isinstance(cause, QueueFull):
                return _error(503, str(cause), retry_after_s=cause.retry_after_s)
            if isinstance(cause, GroupUnavailable):
                return _error(503, str(cause), retry_after_s=5)
            raise

    @app.post("/v1/images/generations", response_model=None)
    async def images(self, req: ImageRequest) -> ImageResponse | JSONResponse:
        self.received += 1
        try:
            t = self._template(req.model, req.size, 1, req.num_inference_steps, "image")
        except UnsupportedTemplate as e:
            return _error(400, str(e), supported_templates=e.supported)

        async def run() -> JSONResponse:
            seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]
            outs = await asyncio.gather(*(self._generate(t, req.prompt, s, req.guidance_scale) for s in seeds))
            body = ImageResponse(created=int(time.time()),
                                 data=[ImageData(b64_json=base64.b64encode(o["data"]).decode()) for o in outs])
            return JSONResponse(content=body.model_dump(), headers=_where(t, outs[0]))

        return await self._guarded(run())

    @app.post("/v1/videos", response_model=None)
    async def videos(self, req: VideoRequest) -> Response:
        self.received += 1
        try:
            t = self._template(req.model, req.size, req.num_frames, req.num_inference_steps, "video")
        except UnsupportedTemplate as e:
            return _error(400, str(e), supported_templates=e.supported)

        async def run() -> Response:
            out = await self._generate(t, req.prompt, req.seed, req.guidance_scale)
            return Response(content=out["data"], media_type="video/mp4",
                            headers={**_where(t, out), "X-Xema-Frames": str(out["frames"])})

        return await self._guarded(run())

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        names = sorted({t.model for t in self.served.values()})
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "xema-ray",
                                            "kind": self.served_kind(n)} for n in names]}

    def served_kind(self, model: str) -> str:
        return next(t.spec.kind for t in self.served.values() if t.model == model)

    @app.get("/v1/templates")
    async def templates(self) -> list[TemplateInfo]:
        out = []
        for key, t in sorted(self.served.items()):
            e = self.table.entries[key]
            out.append(TemplateInfo(template=key, model=t.model, width=t.width, height=t.height, frames=t.frames,
                                    steps=t.steps, latent_length=t.latent_length, plan=e.config.describe(), predicted_latency_s=e.prediction.latency_s,
                                    predicted_peak_gb=e.prediction.peak_bytes / 1e9, slo_s=e.prediction.slo_s))
        return out

    @app.get("/v1/plans")
    async def plans(self) -> dict[str, Any]:
        """The plan table this deployment serves with (for the simulator and for operators)."""
        return self.table.model_dump(mode="json")

    @app.get("/v1/stats")
    async def stats(self) -> dict[str, int]:
        """Requests received by this router replica (valid ones: malformed input is refused earlier)."""
        return {"received": self.received}

    @app.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        statuses = {m: await h.status.remote() for m, h in self.groups.items()}
        return {"status": "ok", "groups": statuses, "plan_hardware": self.table.hardware}
