"""Open-loop HTTP load for the Serve app: each request fires at its own absolute time on its own
task (never waiting for an earlier answer, ARCHITECTURE "locust's poisson() is closed-loop"), and
its outcome is recorded with the app's own timings (``X-Xema-Group-Seconds``: queue + batch time
in the model group; ``X-Xema-Batch-Seconds``; ``X-Xema-Batch-Size``).

Images go to ``/v1/images/generations``, videos to ``/v1/videos/sync`` (the MP4 in the answer), so
a request's latency is one HTTP round trip, measured where the client sees it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from pydantic import BaseModel, Field

from xema_ray.sim.simulate import Arrival
from xema_ray.templates import RequestTemplate


class Outcome(BaseModel):
    """One request as the client saw it (times in seconds from the run's start)."""

    request_id: str
    template: str
    t_sent: float
    latency_s: float | None = Field(description="send to full answer; None: no successful answer (lost)")
    status: int | None = Field(description="HTTP status; None: no answer (connection error or client timeout)")
    group_s: float | None = None
    batch_s: float | None = None
    batch_size: int | None = None
    error: str | None = None


def _request(t: RequestTemplate, prompt: str, guidance_scale: float | None = None) -> tuple[str, dict]:
    size = f"{t.width}x{t.height}"
    guidance = {} if guidance_scale is None else {"guidance_scale": guidance_scale}  # None: the model's default
    if t.spec.kind == "image":
        return "/v1/images/generations", {"model": t.model, "prompt": prompt, "size": size, "response_format": "b64_json",
                                          **guidance}
    return "/v1/videos/sync", {"model": t.model, "prompt": prompt, "size": size, "num_frames": t.frames, **guidance}


async def _one(session: object, base: str, arr: Arrival, t: RequestTemplate, t0: float, timeout_s: float) -> Outcome:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    await asyncio.sleep(max(0.0, t0 + arr.t - time.perf_counter()))
    path, body = _request(t, f"emulated load {arr.request_id}", arr.guidance_scale)
    sent = time.perf_counter()
    try:
        async with session.post(base + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            await r.read()
            done = time.perf_counter()
            h = r.headers
            ok = r.status == 200
            return Outcome(request_id=arr.request_id, template=arr.template, t_sent=sent - t0,
                           latency_s=done - sent if ok else None, status=r.status,
                           group_s=float(h["X-Xema-Group-Seconds"]) if "X-Xema-Group-Seconds" in h else None,
                           batch_s=float(h["X-Xema-Batch-Seconds"]) if "X-Xema-Batch-Seconds" in h else None,
                           batch_size=int(h["X-Xema-Batch-Size"]) if "X-Xema-Batch-Size" in h else None,
                           error=None if ok else (await r.text())[:300])
    except Exception as e:  # counted as lost, with the reason
        return Outcome(request_id=arr.request_id, template=arr.template, t_sent=sent - t0, latency_s=None, status=None,
                       error=f"{type(e).__name__}: {e}"[:300])


async def drive(base: str, arrivals: Sequence[Arrival], templates: dict[str, RequestTemplate],
                timeout_s: float = 300.0) -> list[Outcome]:
    """Send ``arrivals`` open-loop to the app at ``base``; returns every request's outcome."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)  # no client-side cap: the app's own limits answer
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter() + 0.5
        return list(await asyncio.gather(*(_one(session, base, a, templates[a.template], t0, timeout_s) for a in arrivals)))
