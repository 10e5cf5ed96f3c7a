"""Open-loop Poisson load test of the Xema-Ray HTTP API (paper §9.1 workloads).

locust's ``poisson()`` wait time is closed-loop (a user waits for its response before the next
gap), so at 0.5 s latency it delivers half the target rate. Here one dispatcher user follows a
Poisson schedule fixed in advance (absolute times) and fires every request in its own greenlet,
so the arrival process is Poisson whatever the latency. Requests still in flight when the schedule
ends are awaited (up to a grace period) and counted: sent = succeeded + failed-with-status.

Configuration (environment): XEMA_RATE (requests/s), XEMA_DURATION (s), XEMA_MIX (uniform |
skewed), XEMA_ALPHA (skew, default 1), XEMA_SLO_SCALE, XEMA_SEED, XEMA_OUT (results directory),
XEMA_GRACE (s to wait for in-flight requests).

Templates that take reference images get them as a client sends them: image edits as
``POST /v1/images/edits`` (multipart, ``image[]`` per reference), image-to-video as
``input_reference`` (a PNG data URL in the JSON body); each image is seeded noise of the template's
reference size, made once per size.

Videos go through the job API as a client would use it: create (``POST /v1/videos``), poll
``GET /v1/videos/{id}`` at the server's ``openai-poll-after-ms`` hint until the job finishes, then
download the MP4. Each record carries the time to the first progress above 0 and the end-to-end
latency (create to downloaded bytes).

Run: ``make loadtest RATE=0.5 DURATION=60`` (starts the Serve app if needed).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import random
import time
from pathlib import Path

import gevent
from locust import HttpUser, events, task

from loadtests.references import reference_png, reference_size
from loadtests.report import RequestRecord, write_report

RATE = float(os.environ.get("XEMA_RATE", "0.5"))
DURATION = float(os.environ.get("XEMA_DURATION", "60"))
MIX = os.environ.get("XEMA_MIX", "uniform")
ALPHA = float(os.environ.get("XEMA_ALPHA", "1.0"))
SLO_SCALE = float(os.environ.get("XEMA_SLO_SCALE", "1.0"))
SEED = int(os.environ.get("XEMA_SEED", "0"))
OUT = Path(os.environ.get("XEMA_OUT", "loadtests/results"))
GRACE = float(os.environ.get("XEMA_GRACE", "120"))


def _weights(templates: list[dict]) -> list[float]:
    """Uniform, or Figure 10's skew: p_i ∝ exp(α L_i / L_max) with L_i the template's latent length."""
    if MIX == "uniform":
        return [1.0] * len(templates)
    if MIX == "skewed":
        top = max(t["latent_length"] for t in templates)
        import math

        return [math.exp(ALPHA * t["latent_length"] / top) for t in templates]
    raise ValueError(f"XEMA_MIX must be 'uniform' or 'skewed', got {MIX!r}")


class OpenLoopDispatcher(HttpUser):
    """The only user: it dispatches the whole arrival schedule, then stops the run."""

    weight = 1

    def on_start(self) -> None:
        resp = self.client.get("/v1/templates", name="/v1/templates")
        resp.raise_for_status()
        self.templates = resp.json()
        self.rng = random.Random(SEED)
        self.records: list[RequestRecord] = []
        stats = self.client.get("/v1/stats", name="/v1/stats").json()
        self.server_received_before = stats["received"]

    def _image(self, t: dict, body: dict) -> tuple[int, str]:
        refs = int(t.get("references") or 0)
        if refs:  # an edit: multipart, one file per reference (as openai.images.edit sends a list)
            png = reference_png(*reference_size(t))
            post = functools.partial(self.client.post, "/v1/images/edits", data={k: str(v) for k, v in body.items()},
                                     files=[("image[]", (f"ref{i}.png", png, "image/png")) for i in range(refs)])
        else:
            post = functools.partial(self.client.post, "/v1/images/generations", json=body)
        with post(name=t["template"], catch_response=True, timeout=GRACE + DURATION) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return r.status_code, r.text[:200]
        return 200, ""

    def _video_job(self, t: dict, body: dict, start: float) -> tuple[int, str, float | None, int]:
        """Create, poll at the server's hint, download: (status, error, time to first progress, polls)."""
        timeout = GRACE + DURATION
        with self.client.post("/v1/videos", json=body, name=f"{t['template']} create", catch_response=True,
                              timeout=timeout) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return r.status_code, r.text[:200], None, 0
            video = r.json()
            hint = int(r.headers.get("openai-poll-after-ms", "1000"))
        first, polls = None, 0
        while video["status"] in ("queued", "in_progress"):
            gevent.sleep(hint / 1000)
            with self.client.get(f"/v1/videos/{video['id']}", name=f"{t['template']} poll", catch_response=True,
                                 timeout=timeout) as r:
                polls += 1
                if r.status_code != 200:
                    r.failure(f"HTTP {r.status_code}")
                    return r.status_code, r.text[:200], first, polls
                video = r.json()
                hint = int(r.headers.get("openai-poll-after-ms", str(hint)))
            if first is None and (video["progress"] > 0 or video["status"] == "completed"):
                first = time.time() - start
            if time.time() - start > timeout:
                return 0, f"still {video['status']} after {timeout:.0f} s", first, polls
        if video["status"] != "completed":
            return 500, f"job failed: {video.get('error')}", first, polls
        with self.client.get(f"/v1/videos/{video['id']}/content", name=f"{t['template']} download",
                             catch_response=True, timeout=timeout) as r:
            if r.status_code != 200 or not r.content:
                r.failure(f"HTTP {r.status_code}")
                return r.status_code, r.text[:200], first, polls
        return 200, "", first, polls

    def _fire(self, t: dict, scheduled: float, index: int) -> None:
        start = time.time()
        seed = self.rng.randrange(2**31)
        body = {"model": t["model"], "prompt": f"load test {index}", "size": f"{t['width']}x{t['height']}", "seed": seed}
        status, error, first, polls = 0, "", None, 0
        try:
            if t["frames"] == 1:
                status, error = self._image(t, {**body, "n": 1, "response_format": "b64_json"})
            else:
                video = {**body, "num_frames": t["frames"]}
                if t.get("references"):  # image-to-video: the first frame as a data URL
                    png = reference_png(*reference_size(t))
                    video["input_reference"] = "data:image/png;base64," + base64.b64encode(png).decode()
                status, error, first, polls = self._video_job(t, video, start)
        except Exception as e:  # a transport error is still an answered-or-lost request: record it
            error = f"{type(e).__name__}: {e}"
        latency = time.time() - start
        slo = t["slo_s"] * SLO_SCALE
        self.records.append(RequestRecord(index=index, template=t["template"], scheduled_s=scheduled, sent_at=start,
                                          latency_s=latency, status=status, slo_s=slo,
                                          met=status == 200 and latency <= slo, error=error,
                                          first_progress_s=first, polls=polls))

    @task
    def dispatch(self) -> None:
        weights = _weights(self.templates)
        # A Poisson process conditioned on its count is N sorted uniform times: the arrivals are
        # still Poisson (exponential gaps), and the offered rate is exactly RATE over the run
        # instead of drifting by ±1/sqrt(N) from one run to the next.
        n = round(RATE * DURATION)
        schedule = sorted(self.rng.uniform(0.0, DURATION) for _ in range(n))
        t0 = time.time()
        index, greenlets = 0, []
        for at in schedule:
            delay = t0 + at - time.time()
            if delay > 0:
                gevent.sleep(delay)
            t = self.rng.choices(self.templates, weights)[0]
            greenlets.append(gevent.spawn(self._fire, t, at, index))
            index += 1
        gevent.joinall(greenlets, timeout=GRACE)
        stats = self.client.get("/v1/stats", name="/v1/stats").json()
        received = stats["received"] - self.server_received_before
        summary = write_report(self.records, sent=index, duration_s=DURATION, target_rate=RATE,
                               server_received=received, out=OUT, mix=MIX, slo_scale=SLO_SCALE)
        print(json.dumps(summary, indent=1))
        self.environment.runner.quit()


@events.quitting.add_listener
def _exit_code(environment, **_kw) -> None:  # type: ignore[no-untyped-def]
    # failures are part of the measurement (503s under overload), not a failed load test
    environment.process_exit_code = 0
