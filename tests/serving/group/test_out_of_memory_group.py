"""A batch that runs out of device memory, served: the group's in-process CPU worker mirrors its
tensors into the host arena (the device the budget less the weights), the 128² template does not
fit, the 64² one does. The 128² request gets ``DeviceOutOfMemory`` — a JSON 503 with Retry-After
naming the entry, the bytes asked and the bytes free — counted in ``/v1/stats``'s static-layout
counters and the ``xema_out_of_memory`` metric; the same worker serves the next request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from bench.scenarios.group_harness import Harness, entry, request, running_group
from tests.serving.api.asgi_client import call
from xema_ray.runtime.out_of_memory import DeviceOutOfMemory
from xema_ray.serving.api.errors import OOM_RETRY_AFTER_S, exception_response, install_error_handlers
from xema_ray.serving.group.worker_set import WorkerSetSpec
from xema_ray.serving.group.worker_set_local import InProcessWorkerSet
from xema_ray.templates import RequestTemplate

#: issue #35: CUDA's out-of-memory semantics, modelled on the CPU (with the stream tests: ``-m streams``)
pytestmark = pytest.mark.streams

SMALL = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
LARGE = RequestTemplate(model="tiny-flux2", width=128, height=128, steps=2)
#: tiny-flux2's weights (644,608 bytes) and 1.4 MB beside them: a 64² batch mirrors ~0.7 MB, a 128² one ~2.6 MB
BUDGET = 644_608 + 1_400_000


def _host_arena_workers(spec: WorkerSetSpec) -> InProcessWorkerSet:
    return InProcessWorkerSet(spec.model_copy(update={"static_allocator": True}))


class Body(BaseModel):
    template: str


def _front(h: Harness) -> FastAPI:
    """The Router's error handling (``_guarded``, the app's handlers) in front of the group; the Router
    itself needs Serve handles."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/generate", response_model=None)
    async def generate(body: Body) -> dict[str, str] | JSONResponse:
        fut = h.submit(lambda g: g.generate(request(body.template, f"http-{body.template}", "a red fox", 3, steps=SMALL.steps)))
        try:  # as Router._guarded: a replica's error becomes its HTTP status
            out = await asyncio.wrap_future(fut)
        except Exception as e:
            mapped = exception_response(e)
            if mapped is None:
                raise
            return mapped
        return {"media_type": out.media_type}

    return app


def test_a_batch_out_of_device_memory_is_a_json_503_and_the_group_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = {SMALL.shape_key: entry(SMALL), LARGE.shape_key: entry(LARGE)}
    with running_group("tiny-flux2", plans, worker_set=_host_arena_workers, budget_bytes=BUDGET) as h:
        counted: list[dict[str, Any]] = []
        monkeypatch.setattr(h.group.metrics.out_of_memory, "inc", lambda *a, **k: counted.append(k.get("tags", {})))
        with pytest.raises(DeviceOutOfMemory) as e:
            h.call(lambda g: g.generate(request(LARGE.shape_key, "big", "a red fox", 1, steps=LARGE.steps)))
        oom = e.value
        assert oom.entry == LARGE.key and oom.requested_bytes > oom.free_bytes > 0

        r = exception_response(oom)
        assert r is not None and r.status_code == 503
        assert r.headers["content-type"].startswith("application/json")
        assert r.headers["retry-after"] == str(OOM_RETRY_AFTER_S)
        err = json.loads(r.body)["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "device_out_of_memory"
        assert (err["entry"], err["requested_bytes"], err["free_bytes"]) == (LARGE.key, oom.requested_bytes, oom.free_bytes)
        assert f"asked {oom.requested_bytes} bytes" in err["message"]

        ok = h.call(lambda g: g.generate(request(SMALL.shape_key, "next", "a red fox", 2, steps=SMALL.steps)))  # the same worker
        assert ok.media_type == "image/png" and ok.workers == (0,)
        stats = h.call(lambda g: g.layout_stats())
        assert stats.templates[LARGE.shape_key].out_of_memory == 1
        assert stats.templates[LARGE.shape_key].last_out_of_memory == str(oom)
        assert stats.templates[SMALL.shape_key].out_of_memory == 0 and stats.templates[SMALL.shape_key].batches == 1
        assert counted == [{"template": LARGE.shape_key}]
        assert h.call(lambda g: g.status())["status"] == "ok" and h.group.workers.generation == 1  # no rebuild

        # over HTTP, through the app's own error handlers
        app = _front(h)
        big = asyncio.run(call(app, "POST", "/generate", json.dumps({"template": LARGE.shape_key}).encode()))
        assert big.status == 503 and big.headers["retry-after"] == str(OOM_RETRY_AFTER_S)
        body = big.json()["error"]
        assert body["code"] == "device_out_of_memory" and body["entry"] == LARGE.key
        assert body["requested_bytes"] > body["free_bytes"] > 0
        small = asyncio.run(call(app, "POST", "/generate", json.dumps({"template": SMALL.shape_key}).encode()))
        assert small.status == 200 and small.json() == {"media_type": "image/png"}
        assert h.call(lambda g: g.layout_stats()).templates[LARGE.shape_key].out_of_memory == 2


def test_a_ray_actors_out_of_memory_keeps_its_figures_across_the_boundary() -> None:
    import pickle

    from ray.exceptions import RayTaskError

    oom = DeviceOutOfMemory("tiny-flux2/128x128x1/s2/b1: out of device memory on cuda:0: asked 10 bytes; 4 free",
                            "tiny-flux2/128x128x1/s2/b1", 10, 4, "cuda:0")
    back = pickle.loads(pickle.dumps(oom))  # a worker actor's error is pickled to the group
    assert (back.entry, back.requested_bytes, back.free_bytes, back.device, str(back)) == (
        oom.entry, 10, 4, "cuda:0", str(oom))
    wrapped = RayTaskError("execute", "traceback", back).as_instanceof_cause()  # as worker_set_ray raises it
    assert isinstance(wrapped, DeviceOutOfMemory)
    r = exception_response(RayTaskError("generate", "traceback", wrapped))  # and the group's replica again
    assert r is not None and r.status_code == 503 and int(r.headers["retry-after"]) == OOM_RETRY_AFTER_S
    err = json.loads(r.body)["error"]
    assert (err["entry"], err["requested_bytes"], err["free_bytes"]) == (oom.entry, 10, 4)
    assert err["message"] == str(oom)
