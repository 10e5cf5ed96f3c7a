"""What the Router does for the OpenAI video job API (``/v1/videos``), over the job store (``jobs/``).

A router replica keeps no job state: create writes the job to the store and hands it to the
model's group; retrieve, list, download and delete read or change the store, so any replica
answers for any job. Each replica also runs ``reconcile`` in the background: jobs that no live
model group holds — created by a replica that died before dispatching them, or held by a group
replica whose lease lapsed — are taken back (compare-and-set) and dispatched again.

Every endpoint takes the request's tenant (``auth.tenant_of``; None when the API is open): a job
of another tenant answers exactly like one that does not exist. A job id the store does not
know but that was made in an earlier store epoch (the store lost its data) answers 404 with
``code: job_store_lost`` (it existed; the store lost it), never as one that never existed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from xema_ray.plan import PlanTable
from xema_ray.serving.api.schemas import UnsupportedTemplate
from xema_ray.serving.jobs.store import (
    JobRecord,
    JobStore,
    JobStoreConfig,
    TenantBusy,
    epoch_of,
    new_job_id,
    open_store,
    reference_name,
    result_name,
    store_call,
)
from xema_ray.serving.api.media import first_frame_png
from xema_ray.serving.api.errors import cause_of
from xema_ray.serving.group.handle import GroupHandle
from xema_ray.serving.messages import GroupRequest, InvalidRequest, QueueFull
from xema_ray.models.options import OptionRefused
from xema_ray.serving.api.options import option_error, resolve_options, scaled_to_steps
from xema_ray.serving.api.validation import parse_request
from xema_ray.serving.api.edits import data_url_upload, reference_images
from xema_ray.serving.api.uploads import ImageRefused, Upload
from xema_ray.serving.api.videos import (
    VideoCreate,
    VideoDeleted,
    VideoList,
    map_video_request,
    poll_after_ms,
    served_seconds,
    video_view,
)
from xema_ray.templates import RequestTemplate

logger = logging.getLogger("xema_ray.serving")

#: how often each replica purges expired jobs and files
PURGE_INTERVAL_S = 60.0
#: how long a replica reuses a group's predicted run time for new jobs
ESTIMATE_TTL_S = 10.0


class MissingReference(RuntimeError):
    """A stored job's input image is gone from the store: the job can never run."""


class ApiError(Exception):
    """An HTTP error the router renders with its ``_error`` helper."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.extra = status, message, type, param, extra


class VideoJobs:
    """The video job endpoints' logic (one per router replica).

    Args:
        cfg: the job store.
        groups: model name -> the model group's handle.
        served: shape key -> served template.
        table: the plan table (predicted latency per template).
    """

    def __init__(self, cfg: JobStoreConfig, groups: Mapping[str, GroupHandle], served: dict[str, RequestTemplate],
                 table: PlanTable, emulated: bool = False, max_jobs_in_flight: int | None = None) -> None:
        self.cfg = cfg
        self.emulated = emulated  # the box is emulated: every video object says so
        self.max_jobs_in_flight = max_jobs_in_flight
        self.groups = groups
        self.served = served
        self.table = table
        self.replica = uuid.uuid4().hex[:8]
        self._task: asyncio.Task | None = None
        self._last_purge = 0.0
        self._estimates: dict[str, tuple[float, float]] = {}  # template -> (seconds, when asked)
        self._thumbnails: dict[str, asyncio.Future[tuple[bytes, str]]] = {}  # thumbnail being made -> its result

    def store(self) -> JobStore:
        return open_store(self.cfg)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await store_call(self.cfg, fn, *args)

    def start_background(self) -> None:
        """Start ``reconcile`` on this replica's event loop (once)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._background())

    def _headers(self, rec: JobRecord | None = None) -> dict[str, str]:
        h = {"X-Xema-Router": self.replica}
        if rec is not None and rec.status in ("queued", "in_progress"):
            h["openai-poll-after-ms"] = str(poll_after_ms(rec, self.cfg))
        return h

    def _video(self, rec: JobRecord, status: int = 200) -> JSONResponse:
        return JSONResponse(video_view(rec, self.emulated).body(), status_code=status, headers=self._headers(rec))

    async def _live(self, video_id: str, tenant: str | None) -> JobRecord:
        rec = await self._call(self.store().get, video_id)
        if rec is not None and rec.tenant == tenant:
            return rec
        made_in = epoch_of(video_id)
        if rec is None and made_in is not None and made_in != await self._call(self.store().epoch):
            raise ApiError(404, f"video {video_id!r} was lost: the job store lost its data after the job was created "
                                f"(store epoch {made_in}, now another); create it again", type="not_found_error",
                           param="video_id", code="job_store_lost")
        raise ApiError(404, f"no video {video_id!r}: it never existed, was deleted or has expired",
                       type="not_found_error", param="video_id")

    # ------------------------------------------------------------------ endpoints
    async def create(self, request: Request, tenant: str | None = None) -> Response:
        uploads: list[Upload] = []
        req = await parse_request(request, VideoCreate, uploads)
        try:
            if req.input_reference is not None:  # JSON: a data URL
                uploads.append(data_url_upload("input_reference", req.input_reference))
            if len(uploads) > 1:
                raise ImageRefused(f"input_reference: one image is taken, got {len(uploads)}", "input_reference", 400)
            t = map_video_request(req, self.served, len(uploads))
            opts = resolve_options(t, self.served, req, self.table)
            references = await asyncio.to_thread(reference_images, uploads, t) if uploads else ()
        except UnsupportedTemplate as e:
            raise ApiError(400, str(e), param=e.param or "size", code="unsupported_template",
                           supported_templates=e.supported) from None
        except OptionRefused as e:
            err = option_error(e)
            raise ApiError(err["status"], err["message"], param=err["param"], code=err["code"]) from None
        except ImageRefused as e:
            raise ApiError(e.status, str(e), param=e.param, code="invalid_image") from None
        seed = req.seed if req.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        predicted = scaled_to_steps(await self._predicted_s(t), t, opts.steps)
        store = self.store()
        epoch = await self._call(store.epoch)
        rec = JobRecord(id=new_job_id(epoch), model=t.model, template=t.shape_key, prompt=req.prompt, seed=seed,
                        guidance_scale=opts.guidance_scale, guidance_scale_2=opts.guidance_scale_2,
                        negative_prompt=opts.negative_prompt, steps=opts.steps, quality=opts.quality,
                        size=f"{t.width}x{t.height}", seconds=served_seconds(t),
                        frames=t.frames, predicted_s=predicted, created_at=time.time(), tenant=tenant,
                        references=len(references), lora=tuple(req.lora or ()))
        for i, png in enumerate(references):  # before the record: whoever dispatches it finds them
            await self._call(store.put_file, reference_name(rec.id, i), png, "image/png", time.time() + self.cfg.ttl_s)
        try:
            rec = await self._call(store.create, rec, self.max_jobs_in_flight if tenant is not None else None)
        except TenantBusy as e:
            if references:
                await self._call(store.delete_files_of, rec.id)  # a refused create leaves nothing behind
            raise ApiError(429, f"this API key's tenant has {e.active} video jobs queued or running "
                                f"(auth.max_jobs_in_flight {self.max_jobs_in_flight}); wait for one to finish",
                           type="rate_limit_error", code="too_many_jobs", retry_after_s=max(1.0, rec.predicted_s)) from None
        try:
            await self._dispatch(rec)
        except Exception as e:
            refused = cause_of(e)
            if isinstance(refused, QueueFull):  # not accepted: the client retries after Retry-After
                await self._call(store.discard, rec.id)  # a refused create leaves nothing behind
                raise ApiError(503, str(refused), type="service_unavailable", code="queue_full",
                               retry_after_s=refused.retry_after_s) from None
            if isinstance(refused, InvalidRequest):  # it could never run: refused like bad input
                await self._call(store.discard, rec.id)
                not_found = refused.status == 404  # a name of nothing loaded (an adapter), as the sync path says
                raise ApiError(refused.status, str(refused), type="not_found_error" if not_found else "invalid_request_error",
                               param=refused.param, code="not_found" if not_found else "invalid_value") from None
            # the group is unreachable: the job is stored and ``reconcile`` dispatches it later
            logger.exception("dispatching %s failed; it stays queued for re-dispatch", rec.id)
        return self._video(rec)

    async def retrieve(self, video_id: str, tenant: str | None = None) -> Response:
        return self._video(await self._live(video_id, tenant))

    async def list(self, after: str | None, limit: int, order: str, tenant: str | None = None) -> Response:
        try:
            recs, more = await self._call(self.store().list, after, limit, order, tenant)
        except KeyError:
            raise ApiError(404, f"after={after!r} names no video", param="after") from None  # an id of nothing
        views = [video_view(r, self.emulated) for r in recs]
        body = VideoList(data=views, first_id=views[0].id if views else None, last_id=views[-1].id if views else None,
                         has_more=more).model_dump(mode="json")
        body["data"] = [v.body() for v in views]
        return JSONResponse(body, headers=self._headers())

    async def delete(self, video_id: str, tenant: str | None = None) -> Response:
        """Queued: leaves the queue. Running: its batch drops it at the next step (and stops if it
        was the batch's last member). Finished: its files go, every one derived from it."""
        await self._live(video_id, tenant)  # another tenant's job is not there for this one
        names = (result_name(video_id, "video"), result_name(video_id, "thumbnail"))
        before = await self._call(self.store().delete, video_id, names)
        if before is None:
            raise ApiError(404, f"no video {video_id!r}: it never existed, was deleted or has expired",
                           type="not_found_error", param="video_id")
        if before.status == "queued" and before.model in self.groups:
            try:
                await self.groups[before.model].cancel_job(video_id)
            except Exception:  # the group drops it anyway when it finds the tombstone at start
                logger.exception("cancel_job(%s) failed", video_id)
        return JSONResponse(VideoDeleted(id=video_id).model_dump(), headers=self._headers())

    async def content(self, video_id: str, variant: str, tenant: str | None = None) -> Response:
        rec = await self._live(video_id, tenant)
        if variant == "spritesheet":
            raise ApiError(400, "variant 'spritesheet' is not produced; available: video, thumbnail", param="variant")
        if rec.status != "completed":
            raise ApiError(400, f"video {video_id} is not ready: status {rec.status}, progress {video_view(rec).progress}%",
                           param="video_id")
        if variant == "thumbnail":
            got = await self._thumbnail(video_id, rec)
        else:
            got = await self._video_file(video_id)
        return Response(content=got[0], media_type=got[1], headers=self._headers())

    async def _video_file(self, video_id: str) -> tuple[bytes, str]:
        got = await self._call(self.store().get_file, result_name(video_id, "video"))
        if got is None:
            raise ApiError(404, f"the result of {video_id} has expired", type="not_found_error", param="video_id")
        return got

    async def _thumbnail(self, video_id: str, rec: JobRecord) -> tuple[bytes, str]:
        """The first frame as a PNG, made once: requests for a thumbnail not in the store yet wait on
        the one that makes it (on this replica) rather than each reading the video and encoding it."""
        name = result_name(video_id, "thumbnail")
        thumb = await self._call(self.store().get_file, name)
        if thumb is not None:
            return thumb
        making = self._thumbnails.get(name)
        if making is None:
            making = asyncio.ensure_future(self._make_thumbnail(video_id, rec, name))
            self._thumbnails[name] = making
            making.add_done_callback(lambda _: self._thumbnails.pop(name, None))
        return await asyncio.shield(making)  # a client that goes away does not cancel the others' thumbnail

    async def _make_thumbnail(self, video_id: str, rec: JobRecord, name: str) -> tuple[bytes, str]:
        video = await self._video_file(video_id)
        png = await asyncio.to_thread(first_frame_png, video[0])
        await self._call(self.store().put_file, name, png, "image/png", rec.expires_at or time.time() + self.cfg.ttl_s)
        # a DELETE that ran while the thumbnail was made removed the files before this one was
        # written: look again, and take it back (the job is gone for this client too)
        if await self._call(self.store().get, video_id) is None:
            await self._call(self.store().delete_file, name)
            raise ApiError(404, f"no video {video_id!r}: it was deleted", type="not_found_error", param="video_id")
        return png, "image/png"

    # ------------------------------------------------------------------ dispatch
    async def _predicted_s(self, t: RequestTemplate) -> float:
        """The group's current estimate for ``t`` (asked at most every ``ESTIMATE_TTL_S``)."""
        cached = self._estimates.get(t.shape_key)
        if cached is not None and time.monotonic() - cached[1] < ESTIMATE_TTL_S:
            return cached[0]
        try:
            value = await self.groups[t.model].estimate(t.shape_key)
        except Exception:  # the group is unreachable: the plan's prediction
            value = max(1e-3, self.table.entries[t.shape_key].prediction.latency_s)
        self._estimates[t.shape_key] = (value, time.monotonic())
        return value

    async def _dispatch(self, rec: JobRecord) -> bool:
        references = []
        for i in range(rec.references):
            got = await self._call(self.store().get_file, reference_name(rec.id, i))
            if got is None:
                raise MissingReference(f"{rec.id}: its reference image {i} is missing from the job store (expired "
                                       "or deleted); create the job again")
            references.append(got[0])
        return await self.groups[rec.model].submit_job(GroupRequest(
            template=rec.template, request_id=rec.id, prompt=rec.prompt, seed=rec.seed,
            guidance_scale=rec.guidance_scale, guidance_scale_2=rec.guidance_scale_2,
            negative_prompt=rec.negative_prompt, steps=rec.steps, quality=rec.quality,
            references=tuple(references), lora=rec.lora))

    async def reconcile(self) -> int:
        """Dispatch the jobs no live model group holds; returns how many were dispatched."""
        store = self.store()
        n = 0
        for rec in await self._call(store.orphans, self.cfg.lease_s):
            if rec.owner is not None:  # its group replica died: take the job back first (one taker wins)
                taken = await self._call(store.requeue, rec.id, rec.owner)
                if taken is None:
                    continue
                rec = taken
            if rec.model not in self.groups:
                continue
            try:
                n += await self._dispatch(rec)
            except Exception as e:
                refused = cause_of(e)
                if isinstance(refused, (InvalidRequest, MissingReference)):  # it can never run: say why, once
                    await self._call(store.fail, rec.id, "invalid_request", str(refused))
                    continue
                # full or unreachable: it stays an orphan for the next round
                logger.info("re-dispatching %s failed (%s); retrying later", rec.id, refused)
        if time.time() - self._last_purge > PURGE_INTERVAL_S:
            self._last_purge = time.time()
            await self._call(store.purge_expired)
        return n

    async def _background(self) -> None:
        while True:
            try:
                dispatched = await self.reconcile()
                if dispatched:
                    logger.warning("re-dispatched %d orphaned video job(s)", dispatched)
            except Exception:  # the store may be briefly unreachable; keep trying
                logger.exception("video job reconciliation failed")
            await asyncio.sleep(max(0.2, self.cfg.lease_s / 2))
