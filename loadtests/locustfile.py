"""Open-loop Poisson load test of the Xema-Ray HTTP API (paper §9.1 workloads).

locust's ``poisson()`` wait time is closed-loop (a user waits for its response before the next
gap), so at 0.5 s latency it delivers half the target rate. Here one dispatcher user follows a
Poisson schedule fixed in advance (absolute times) and fires every request in its own greenlet,
so the arrival process is Poisson whatever the latency. Requests still in flight when the schedule
ends are awaited (up to a grace period) and counted: sent = succeeded + failed-with-status.

Configuration (environment): XEMA_RATE (requests/s), XEMA_DURATION (s), XEMA_MIX (uniform |
skewed), XEMA_ALPHA (skew, default 1), XEMA_SLO_SCALE, XEMA_SEED, XEMA_OUT (results directory),
XEMA_GRACE (s to wait for in-flight requests).

Run: ``make loadtest RATE=0.5 DURATION=60`` (starts the Serve app if needed).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import gevent
from locust import HttpUser, events, task

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

    def _fire(self, t: dict, scheduled: float, index: int) -> None:
        start = time.time()
        seed = self.rng.randrange(2**31)
        if t["frames"] == 1:
            path = "/v1/images/generations"
            body = {"model": t["model"], "prompt": f"load test {index}", "size": f"{t['width']}x{t['height']}",
                    "n": 1, "response_format": "b64_json", "seed": seed}
        else:
            path = "/v1/videos"
            body = {"model": t["model"], "prompt": f"load test {index}", "size": f"{t['width']}x{t['height']}",
                    "num_frames": t["frames"], "seed": seed}
        status, error = 0, ""
        try:
            with self.client.post(path, json=body, name=t["template"], catch_response=True, timeout=GRACE + DURATION) as r:
                status = r.status_code
                if status != 200:
                    error = r.text[:200]
                    r.failure(f"HTTP {status}")
        except Exception as e:  # a transport error is still an answered-or-lost request: record it
            error = f"{type(e).__name__}: {e}"
        latency = time.time() - start
        slo = t["slo_s"] * SLO_SCALE
        self.records.append(RequestRecord(index=index, template=t["template"], scheduled_s=scheduled, sent_at=start,
                                          latency_s=latency, status=status, slo_s=slo,
                                          met=status == 200 and latency <= slo, error=error))

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
