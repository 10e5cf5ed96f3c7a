"""The HTTP ingress (Ray Serve + FastAPI): OpenAI-style endpoints, template mapping, errors.

Status codes (``errors.py`` has the table and the JSON shape): 422 malformed input naming the
field, 400 a well-formed request for a template this deployment does not serve (with the list it
does serve), 413 / 415 a body too large / not JSON, 503 with Retry-After when a queue is full,
the server is busy or a worker set / replica died, 500 only for bugs.

Video jobs (``/v1/videos``, the OpenAI video API) live in the job store; every replica answers
for every job, and each replica re-dispatches jobs no model group holds (``VideoJobs.reconcile``).
"""

# no `from __future__ import annotations`: FastAPI must see the request models as real classes

import asyncio
import base64
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from xema_ray.lora_pool import LoraPoolConfig, LoraUse
from xema_ray.plan import PlanTable
from xema_ray.serving.api.adapters import ADD_ROUTE, DELETE_ROUTE, LIST_ROUTE, AdapterAdmin
from xema_ray.serving.api.schemas import (
    ImageData,
    ImageRequest,
    ImageResponse,
    RequestLimits,
    DecodeInfo,
    TemplateInfo,
    UnsupportedTemplate,
    VideoRequest,
    match_template,
    parse_size,
    set_limits,
)
from xema_ray.serving.api.auth import AuthConfig, TenantGuard, set_auth, tenant_of
from xema_ray.serving.console.operator import operator_view
from xema_ray.serving.console.schemas import OperatorView, TraceView
from xema_ray.serving.console.static import install_ui
from xema_ray.serving.api.errors import error_response, exception_response, install_error_handlers
from xema_ray.serving.api.health import (
    HEALTHZ_FRESH_S,
    STARTING_RETRY_AFTER_S,
    GroupHealth,
    HealthResponse,
    serve_replica_counts,
)
from xema_ray.serving.group.handle import GroupHandle
from xema_ray.serving.group.preemption import PreemptionReport
from xema_ray.serving.stats import QUALITY_COUNT, BufferedCounts, StatsResponse
from xema_ray.serving.api.wake import WakeGate, WakePolicy, wake_stats
from xema_ray.serving.api.middleware import RequestGuard
from xema_ray.serving.api.refusals import RefusalMeter
from xema_ray.serving.api.responses import documented as _documented, front_timing as _front_timing, where_headers as _where
from xema_ray.serving.messages import GenerateResult, GroupLayoutStats, GroupRequest, GroupUnavailable
from xema_ray.serving.group.plan_reload import RouterPlans
from xema_ray.serving.api.openapi import install_openapi
from xema_ray.serving.jobs.store import JobStore, JobStoreConfig, open_store, store_call, store_faults
from xema_ray.serving.api.media import MEDIA_TYPES, transcode_image
from xema_ray.serving.api.video_jobs import ApiError, VideoJobs
from xema_ray.models.options import OptionRefused
from xema_ray.serving.api.options import RequestOptions, option_error, quality_note, resolve_options
from xema_ray.serving.api.quality import quality_tier_infos, served_tiers
from xema_ray.serving.api.validation import parse_request, request_body_doc
from xema_ray.serving.api.edits import ImageEditRequest, edit_body_doc, edit_inputs
from xema_ray.serving.api.uploads import ImageRefused, Upload
from xema_ray.serving.api.videos import VideoCreate
from xema_ray.serving.replica_bind import bind_replica_servers_to_node
from xema_ray.templates import RequestTemplate

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

#: the path parameters whose values another answer gives (the OpenAPI document says which)
VideoId = Annotated[str, Path(description="a video job's id: the `id` that `POST /v1/videos` answered (`GET /v1/videos` "
                                          "lists the caller's jobs)")]
AdapterName = Annotated[str, Path(description="an adapter's name, as `POST /v1/adapters` registered it (`GET /v1/adapters` "
                                              "lists them)")]
ImageFileName = Annotated[str, Path(description="a stored image's file name: the last part of the `url` an image request "
                                                "with `response_format: url` answered")]
TemplateKey = Annotated[str, Path(description="a served template's key, e.g. `tiny-flux2/64x64x1`, as `GET /v1/templates` "
                                              "lists them (`template`)")]

app = FastAPI(title="Xema-Ray", description="Diffusion serving with trace-guided memory mitigation and planned execution")
install_error_handlers(app)
app.add_middleware(RequestGuard)
app.add_middleware(TenantGuard)  # runs before RequestGuard: no key, no body read
app.add_middleware(RefusalMeter)  # added last, so it runs first: it sees every refusal, the 401s too
install_ui(app)  # /ui: the console's static pages (docs/console.md)


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    if "supported_templates" in extra:
        extra.setdefault("code", "unsupported_template")
    return error_response(status, message, **extra)


def _group_handles(groups: Mapping[str, "DeploymentHandle"], shared: Mapping[str, str] | None) -> dict[str, GroupHandle]:
    """Each group's typed handle: its own deployment's (``ModelGroup:<model>``), or for a group a
    ``SharedReplica`` holds (``shared``: model -> that deployment) the shared replica's, naming the member."""
    shared = shared or {}
    return {m: GroupHandle(h, member=m, deployment=shared[m]) if m in shared else
            GroupHandle(h, deployment=f"ModelGroup:{m}") for m, h in groups.items()}


def _replica_counter(deployments: dict[str, str]):  # type: ignore[no-untyped-def]
    """Serve's controller's count of each group's running replicas (``deployments``: model -> the
    deployment that runs it), for this Router's application (None outside a Serve replica, e.g. in
    tests that call the Router directly)."""
    try:
        app_name = serve.get_replica_context().app_name
    except Exception:  # not inside a Serve replica
        return None

    async def counts() -> dict[str, int] | None:
        return await serve_replica_counts(app_name, deployments)

    return counts


#: a Router replica adds its received requests to the Stats deployment at most this often
COUNT_FLUSH_S = 0.5

#: longest wait for a group's stats (a group that answers later is left out of that answer)
STATS_TIMEOUT_S = 5.0


@serve.ingress(app)
class Router:
    """Maps requests to templates, looks up the plan, forwards to the model's group.

    ``groups`` (model name -> its group's deployment handle, or its ``SharedReplica``'s for the models
    ``shared`` names: model -> that deployment) are held as typed ``GroupHandle``s;
    the adapter admin endpoints hand their work to ``adapter_admin`` (``AdapterAdmin``), the
    groups' state to ``health`` (``GroupHealth``), the video job API to ``jobs`` (``VideoJobs``).
    """

    def __init__(self, groups: Mapping[str, "DeploymentHandle"], table: PlanTable, templates: list[RequestTemplate], stats: Any = None,
                 limits: RequestLimits | None = None, jobs: JobStoreConfig | None = None, emulated: bool = False,
                 auth: AuthConfig | None = None,
                 console_traces: Callable[[str, Any, int], TraceView] | None = None,
                 adapter_pools: dict[str, LoraPoolConfig] | None = None,
                 wake: dict[str, WakePolicy] | None = None, shared: dict[str, str] | None = None) -> None:
        bind_replica_servers_to_node()  # before Serve starts this replica's gRPC server (replica_bind)
        self.groups: dict[str, GroupHandle] = _group_handles(groups, shared)
        self.adapter_admin = AdapterAdmin(self.groups)
        self.emulated = emulated  # an emulated box (docs/emulated.md): video objects say so
        self.health = GroupHealth(self.groups, replica_counts=_replica_counter({m: str(h.deployment) for m, h in sorted(self.groups.items())}),
                                  sleepers=frozenset(wake or {}))
        try:  # probe from start-up on, so that /healthz knows the groups before anyone asks
            self.health.ensure_started()
        except RuntimeError:  # no running loop here: the first request starts them
            pass
        self.stats = stats  # the Stats deployment: counters that outlive this replica
        self.limits = limits or RequestLimits()
        set_limits(self.limits)
        self.auth = auth or AuthConfig()
        set_auth(self.auth)
        self.table = table
        self.served: dict[str, RequestTemplate] = {t.shape_key: t for t in templates}
        self._ids = itertools.count()
        self.received = 0  # generation requests that reached this replica (the Stats deployment counts all)
        self.served_quality: dict[str, int] = {}  # answered, by the tier served (the Stats deployment counts all)
        self.console_traces = console_traces  # (template, plan entry, budget) -> TraceView
        self._counts = BufferedCounts(self._stats_add, COUNT_FLUSH_S) if stats is not None else None
        # the groups that scale to zero: their requests are held while they wake (api/wake.py)
        self.wake = WakeGate(dict(wake or {}), self.health, self._counts.add if self._counts is not None else None)
        # the document states this deployment: its templates, planned batches, adapter pools, job store
        install_openapi(app, self.served, self.limits, {k: table.entries[k].config.batch for k in self.served},
                        adapter_pools or {}, url_images=jobs is not None,
                        tiers={k: frozenset(q.value for q in served_tiers(t, table)) for k, t in self.served.items()})
        self.jobs_cfg = jobs
        self.jobs = VideoJobs(self.jobs_cfg, self.groups, self.served, self.table, emulated,
                              self.auth.max_jobs_in_flight) if self.jobs_cfg else None
        if self.jobs is not None:
            try:  # re-dispatch orphaned jobs from start-up on, not only once a request arrives
                self.jobs.start_background()
            except RuntimeError:  # no running loop here: the first request starts it
                pass

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's in-place config update (``xema serve --reload-plans``, ``plan_reload``): the new
        plan table this replica reports (``/v1/templates``, ``/v1/plans``) and predicts jobs with;
        the groups swap their own plans."""
        self.table = RouterPlans.model_validate(user_config).table
        if self.jobs is not None:
            self.jobs.table = self.table

    # ------------------------------------------------------------------ adapters (api/adapters.py)
    @app.post("/v1/adapters", **ADD_ROUTE)
    async def add_adapter(self, request: Request) -> Any:
        """Load an adapter file on every worker of its model's group, without a restart."""
        return await self.adapter_admin.add_adapter(request)

    @app.get("/v1/adapters", **LIST_ROUTE)
    async def list_adapters(self, request: Request) -> Any:
        """Every model's loaded adapters and its pools' residency (behind API keys, each adapter's
        server-side file path only for an admin key)."""
        return await self.adapter_admin.list_adapters(request)

    @app.delete("/v1/adapters/{name}", **DELETE_ROUTE)
    async def delete_adapter(self, name: AdapterName, request: Request, model: str | None = None) -> Any:
        """Unload ``name`` (of ``?model=``, or of every model that has it)."""
        return await self.adapter_admin.delete_adapter(name, request, model)

    def _count_received(self) -> None:
        """One generation request arrived: counted here and, without waiting, in Stats (in one
        call per ``COUNT_FLUSH_S`` for every request since the last: ``BufferedCounts``)."""
        self.received += 1
        if self._counts is not None:
            self._counts.add("received")

    def _count_served(self, quality: str) -> None:
        """One request answered at tier ``quality`` (``/v1/stats``'s ``quality``), here and in Stats."""
        key = f"{QUALITY_COUNT}{quality}"
        self.served_quality[quality] = self.served_quality.get(quality, 0) + 1
        if self._counts is not None:
            self._counts.add(key)

    def _request_id(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def _template(self, model: str, size: str, frames: int, kind: str) -> RequestTemplate:
        width, height = parse_size(size)
        return match_template(model, width, height, frames, self.served, kind)  # type: ignore[arg-type]

    async def _generate(self, t: RequestTemplate, prompt: str, seed: int | None, opts: RequestOptions,
                        references: tuple[bytes, ...] = (), lora: list[LoraUse] | None = None) -> GenerateResult:
        handle = self.groups[t.model]
        self.health.ensure_started()
        waking = self.wake.waking(t.model)  # scaled to zero, or waking: held, not refused
        if waking:
            latency = self.table.entries[t.shape_key].prediction.latency_s
            self.wake.enter(t.model, t.shape_key, retry_after_s=max(1.0, latency))  # a full queue: as admission
        else:
            self.health.admit(t.model)  # 503 only while the group is starting or its replica is known gone
        seed = seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        # accepted: waited for until it answers, or until a fact says its group is gone (Ray's death
        # error, or Serve's controller reporting no running replica) — never because it is slow
        response = handle.generate(GroupRequest(template=t.shape_key, request_id=self._request_id(), prompt=prompt,
                                                       seed=seed, guidance_scale=opts.guidance_scale,
                                                       guidance_scale_2=opts.guidance_scale_2,
                                                       negative_prompt=opts.negative_prompt, steps=opts.steps,
                                                       quality=opts.quality,
                                                       references=references, lora=tuple(lora or ())))

        async def result() -> GenerateResult:
            return await response

        call = asyncio.ensure_future(result())
        if waking:  # Serve wakes the group for the request waiting at its handle; held up to the wake timeout
            await self.wake.hold(t.model, t.shape_key, call, response)
        gone = asyncio.ensure_future(self.health.wait_gone(t.model))
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                result = call.result()
                self._count_served(result.quality)
                return result
            response.cancel()
            call.cancel()
            raise GroupUnavailable(f"{t.model}: {gone.result()}; the request was not completed, retry later")
        finally:
            gone.cancel()

    async def _guarded(self, coro) -> Any:  # type: ignore[no-untyped-def]
        try:
            return await coro
        except Exception as e:  # translate the replica's error into an HTTP status (errors.py)
            mapped = exception_response(e)
            if mapped is None:
                raise
            return mapped

    @app.post("/v1/images/generations", response_model=None, openapi_extra=request_body_doc(ImageRequest))
    async def images(self, request: Request) -> ImageResponse | JSONResponse:
        return await self._images(request, ImageRequest)

    @app.post("/v1/images/edits", response_model=None, openapi_extra=edit_body_doc())
    async def image_edits(self, request: Request) -> ImageResponse | JSONResponse:
        """Images conditioned on reference images (``openai.images.edit``: multipart, ``image`` once
        or ``image[]`` per file); the template is chosen as ``edits.py`` says."""
        return await self._images(request, ImageEditRequest)

    async def _images(self, request: Request, schema: type[ImageRequest]) -> ImageResponse | JSONResponse:
        entered = time.perf_counter()
        self._count_received()
        uploads: list[Upload] = []
        req = await parse_request(request, schema, uploads)
        if req.response_format == "url" and self.jobs_cfg is None:
            return _error(400, "response_format='url' needs the job store (jobs: in the deployment config)",
                          param="response_format")
        references: tuple[bytes, ...] = ()
        try:
            if schema is ImageEditRequest:
                t, references = await edit_inputs(req, uploads, self.served)
            else:
                t = self._template(req.model, req.size, 1, "image")
            opts = resolve_options(t, self.served, req, self.table)
        except UnsupportedTemplate as e:
            return _error(400, str(e), supported_templates=e.supported, param=e.param)
        except OptionRefused as e:
            return error_response(**option_error(e))
        except ImageRefused as e:
            return _error(e.status, str(e), param=e.param, code="invalid_image")
        batch = self.table.entries[t.shape_key].config.batch
        if req.n > batch:
            return _error(400, f"n={req.n} exceeds {t.shape_key}'s planned batch of {batch}; ask for n <= {batch}",
                          param="n")

        if req.response_format == "url":
            # the link needs the store: a store that is down is said now, before the work starts
            # (a store that fails after it answers with the image inline instead, b64_json)
            try:
                await store_call(self.jobs_cfg, self._store().epoch)  # type: ignore[arg-type]
            except store_faults() as e:
                return _error(503, f"the job store is unavailable ({type(e).__name__}); response_format='url' needs "
                                   "it: retry later or ask for b64_json", type_="service_unavailable",
                              code="store_unavailable", param="response_format", retry_after_s=5)

        async def run() -> JSONResponse:
            seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]
            called = time.perf_counter()
            outs = await asyncio.gather(*(self._generate(t, req.prompt, s, opts, references, req.lora) for s in seeds))
            answered = time.perf_counter()
            data = [await self._image_data(o.data, req, str(request.base_url)) for o in outs]
            body = ImageResponse(created=int(time.time()), data=data, output_format=req.output_format, size=f"{t.width}x{t.height}",
                                 emulated=True if any(o.emulated for o in outs) else None)
            response = JSONResponse(content=body.model_dump(exclude_none=True),
                                    headers={**_where(t, outs[0]), **quality_note(t, req, self.table)})
            response.headers.update(_front_timing(entered, called, answered))
            return response

        return await self._guarded(run())

    async def _image_data(self, png: bytes, req: ImageRequest, base_url: str) -> ImageData:
        data = await asyncio.to_thread(transcode_image, png, req.output_format, req.output_compression)
        if req.response_format == "b64_json":
            return ImageData(b64_json=base64.b64encode(data).decode())
        assert self.jobs_cfg is not None
        name = f"img_{uuid.uuid4().hex}.{req.output_format}"
        try:
            await store_call(self.jobs_cfg, self._store().put_file, name, data, MEDIA_TYPES[req.output_format],
                             time.time() + self.jobs_cfg.ttl_s)
        except store_faults():  # the work is done: never thrown away for a link (the client reads either field)
            return ImageData(b64_json=base64.b64encode(data).decode())
        return ImageData(url=f"{base_url.rstrip('/')}/v1/images/files/{name}")

    def _store(self) -> JobStore:
        assert self.jobs_cfg is not None
        return open_store(self.jobs_cfg)

    @app.get("/v1/images/files/{name}", response_model=None,
             responses=_documented(404, media=("image/png", "image/jpeg", "image/webp")))
    async def image_file(self, name: ImageFileName) -> Response:
        """An image generated with ``response_format="url"`` (until it expires)."""
        got = None
        if self.jobs_cfg is not None and name.startswith("img_") and "/" not in name:
            try:
                got = await store_call(self.jobs_cfg, self._store().get_file, name)
            except store_faults() as e:
                return _error(503, f"the job store is unavailable ({type(e).__name__}); retry later",
                              type_="service_unavailable", code="store_unavailable", retry_after_s=5)
        if got is None:
            return _error(404, f"no image {name!r} (it never existed or expired)", type_="not_found_error", param="name")
        return Response(content=got[0], media_type=got[1])

    # ------------------------------------------------------------------ video jobs (OpenAI video API)
    async def _job_api(self, call: Callable[[VideoJobs], Awaitable[Response]]) -> Response:
        if self.jobs is None:
            return _error(400, "video jobs need the job store (jobs: in the deployment config)")
        self.jobs.start_background()
        try:
            return await call(self.jobs)
        except ApiError as e:
            return _error(e.status, e.message, type_=e.type, param=e.param, **e.extra)
        except store_faults() as e:  # nothing was lost: the client retries
            return _error(503, f"the job store is unavailable ({type(e).__name__}: {e}); retry later",
                          type_="service_unavailable", code="store_unavailable", retry_after_s=5)

    @app.post("/v1/videos", response_model=None, openapi_extra=request_body_doc(VideoCreate), responses=_documented(429))
    async def create_video(self, request: Request) -> Response:
        """Create a video job (JSON or multipart, as ``openai.videos.create`` sends it)."""
        self._count_received()
        return await self._job_api(lambda j: j.create(request, tenant_of(request)))

    @app.get("/v1/videos", response_model=None, responses=_documented(400, 404))
    async def list_videos(self, request: Request, after: str | None = None,
                          limit: int = Query(default=20, ge=1, le=100),
                          order: Literal["asc", "desc"] = "desc") -> Response:
        return await self._job_api(lambda j: j.list(after, limit, order, tenant_of(request)))

    @app.get("/v1/videos/{video_id}", response_model=None, responses=_documented(404))
    async def retrieve_video(self, video_id: VideoId, request: Request) -> Response:
        return await self._job_api(lambda j: j.retrieve(video_id, tenant_of(request)))

    @app.delete("/v1/videos/{video_id}", response_model=None, responses=_documented(404))
    async def delete_video(self, video_id: VideoId, request: Request) -> Response:
        return await self._job_api(lambda j: j.delete(video_id, tenant_of(request)))

    @app.get("/v1/videos/{video_id}/content", response_model=None,
             responses=_documented(400, 404, media=("video/mp4", "image/png")))
    async def video_content(self, video_id: VideoId, request: Request,
                            variant: Literal["video", "thumbnail", "spritesheet"] = "video") -> Response:
        return await self._job_api(lambda j: j.content(video_id, variant, tenant_of(request)))

    @app.post("/v1/videos/sync", response_model=None, openapi_extra=request_body_doc(VideoRequest))
    async def videos_sync(self, request: Request) -> Response:
        """The synchronous path: waits for the video and answers with the MP4."""
        self._count_received()
        req = await parse_request(request, VideoRequest)
        try:
            t = self._template(req.model, req.size, req.num_frames, "video")
            opts = resolve_options(t, self.served, req, self.table)
        except UnsupportedTemplate as e:
            return _error(400, str(e), supported_templates=e.supported, param=e.param)
        except OptionRefused as e:
            return error_response(**option_error(e))

        async def run() -> Response:
            out = await self._generate(t, req.prompt, req.seed, opts, lora=req.lora)
            return Response(content=out.data, media_type="video/mp4",
                            headers={**_where(t, out), **quality_note(t, req, self.table), "X-Xema-Frames": str(out.frames)})

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
            rules = t.spec.option_rules()
            out.append(TemplateInfo(template=key, model=t.model, width=t.width, height=t.height, frames=t.frames,
                                    steps=t.steps, steps_range=(rules.steps_min, rules.steps_max),
                                    options=rules.describe(), references=t.references,
                                    reference_size=f"{t.reference_width}x{t.reference_height}" if t.references else None,
                                    latent_length=t.latent_length, plan=e.config.describe(), predicted_latency_s=e.prediction.latency_s,
                                    predicted_peak_gb=e.prediction.peak_bytes / 1e9, slo_s=e.prediction.slo_s,
                                    quality_tiers=quality_tier_infos(e),
                                    decode=DecodeInfo(workers=e.config.decode.workers,
                                                      gpus_per_worker=e.config.decode.gpus_per_worker)
                                    if e.config.decode is not None else None))
        return out

    @app.get("/v1/plans")
    async def plans(self) -> dict[str, Any]:
        """The plan table this deployment serves with (for the simulator and for operators)."""
        return self.table.model_dump(mode="json")

    @app.get("/v1/stats")
    async def stats(self) -> StatsResponse:
        """Generation requests received (valid ones: malformed input is refused earlier), by every
        Router replica since the application started (kept in the Stats deployment; this
        replica's own count when Stats cannot be reached), each model group's static-allocator
        counters per template (armed batches, hits, fallbacks, reserved bytes; zeros and the
        reason where nothing is armed, e.g. on CPU) and its step-level preemption (batches paused,
        bytes the paused ones hold, seconds paused; a group that does not answer in time is left out)."""
        received = self.received
        quality = dict(self.served_quality)
        counts = dict(self.wake.local)  # this replica's own, unless Stats answers for every replica
        if self.stats is not None:
            if self._counts is not None:
                await self._counts.flush()  # this replica's own requests are in the answer
            try:
                counts = await asyncio.wait_for(self._stats_counts(), timeout=2.0)
                received = counts.get("received", 0)
                quality = {k.removeprefix(QUALITY_COUNT): n for k, n in counts.items() if k.startswith(QUALITY_COUNT)}
            except Exception:
                pass
        layouts, preemption, adapters = await asyncio.gather(self._layout_stats(), self._preemption_stats(),
                                                             self.adapter_admin.pool_stats(STATS_TIMEOUT_S, self.health.quiet))
        return StatsResponse(received=received, quality=dict(sorted(quality.items())), static_layouts=layouts,
                             preemption=preemption, adapters=adapters,
                             waking=wake_stats(counts, sorted(self.wake.policies)))

    async def _layout_stats(self) -> dict[str, GroupLayoutStats]:
        async def ask(model: str) -> GroupLayoutStats:
            try:
                raw = await asyncio.wait_for(self._group_layout_stats(model), timeout=STATS_TIMEOUT_S)
                return GroupLayoutStats.model_validate(raw)
            except Exception as e:  # a group being replaced must not fail the stats
                return GroupLayoutStats(status=f"unavailable: {type(e).__name__}")
        models = [m for m in sorted(self.groups) if not self.health.quiet(m)]  # a call would wake a group at zero
        asked = dict(zip(models, await asyncio.gather(*(ask(m) for m in models)), strict=True))
        return {m: asked.get(m) or GroupLayoutStats(status="asleep: scaled to zero, not asked")
                for m in sorted(self.groups)}

    async def _group_layout_stats(self, model: str) -> GroupLayoutStats:
        return await self.groups[model].layout_stats()

    async def _preemption_stats(self) -> dict[str, PreemptionReport]:
        async def ask(model: str) -> PreemptionReport | None:
            try:
                raw = await asyncio.wait_for(self._group_preemption_stats(model), timeout=STATS_TIMEOUT_S)
                return PreemptionReport.model_validate(raw)
            except Exception:  # a group being replaced is left out rather than failing the stats
                return None
        models = [m for m in sorted(self.groups) if not self.health.quiet(m)]  # a call would wake a group at zero
        answers = await asyncio.gather(*(ask(m) for m in models))
        return {m: r for m, r in zip(models, answers, strict=True) if r is not None}

    async def _group_preemption_stats(self, model: str) -> PreemptionReport:
        return await self.groups[model].preemption_stats()

    async def _stats_add(self, name: str, n: int = 1) -> None:
        await self.stats.add.remote(name, n)

    async def _stats_counts(self) -> dict[str, int]:
        return await self.stats.get.remote()

    @app.get("/v1/console/operator", responses=_documented(403))
    async def console_operator(self) -> OperatorView:
        """The operator view's data (docs/console.md). Behind API keys: an admin key."""
        return await operator_view(self, await type(self).stats(self))  # self.stats: the Stats deployment

    @app.get("/v1/console/traces/{template:path}", response_model=None, responses=_documented(403, 404))
    async def console_trace(self, template: TemplateKey) -> TraceView | JSONResponse:
        """A template's memory trace against the budget (docs/console.md). Behind API keys: an admin key."""
        if template not in self.served or template not in self.table.entries or self.console_traces is None:
            return _error(404, f"no trace of {template!r} here", type_="not_found_error", param="template")
        return await asyncio.to_thread(self.console_traces, template, self.table.entries[template], self.table.budget_bytes)

    @app.get("/healthz", response_model=None,
             responses={200: {"model": HealthResponse, "description": "ready: every group can take a request"},
                        503: {"model": HealthResponse, "description": "not ready (starting or degraded), with "
                                                                       "Retry-After"}})
    async def healthz(self) -> JSONResponse:
        """Readiness: 200 only when every group can take a request; otherwise 503 (Retry-After)
        with each group's state (``starting``, ``degraded``, ``ok``) and why. Answered from what
        the background probes know (``health.py``): it never waits for a group, and a group that
        answers slowly under load is not reported down."""
        await self.health.fresh(HEALTHZ_FRESH_S)
        body = self.health.health(self.table.hardware)
        headers = {} if body.ready else {"Retry-After": str(STARTING_RETRY_AFTER_S)}
        return JSONResponse(content=body.model_dump(mode="json"), status_code=200 if body.ready else 503,
                            headers=headers)

    @app.get("/livez")
    async def livez(self) -> dict[str, str]:
        """Liveness of this Router replica: 200 as long as it answers HTTP (ready or not)."""
        self.health.ensure_started()
        return {"status": "alive"}

    def check_health(self) -> None:
        """Serve's own health check of this replica (``health_check_period_s``): it fails only
        when a group's probe task died of a bug, so that Serve replaces the replica."""
        self.health.check()

