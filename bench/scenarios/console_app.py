"""The app the console's browser test and benchmark drive (``tests/serving/test_console_browser.py``,
``bench/bench_console.py``): tiny Flux.2 (image) and tiny CogVideoX (video jobs) on CPU, one
worker each (threads of one shared replica, as ``make serve`` runs its groups), API keys on (a user key and an admin key), a budget below CogVideoX's unmitigated
peak so that its trace shows pressure intervals and the plan a VAE mitigation placed on them;
and Chromium (Debian's ``chromium``, driven by Playwright's bundled driver: nothing downloads a
browser) with every request URL recorded."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.scenarios.factories import plan_entry
from xema_ray.plan import Mitigation, PlanTable
from xema_ray.templates import RequestTemplate

FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=8)
USER_KEY = "console-user-" + "u" * 20
ADMIN_KEY = "console-admin-" + "a" * 20
#: per GPU: above tiny CogVideoX's planned peak (15.7 MB traced), below its unmitigated one (20.4 MB)
BUDGET = 18 * 10**6


def app_args(jobs_dir: Path) -> dict[str, Any]:
    return {
        # the groups' workers threads of one shared replica, as make serve runs them
        "device": "cpu", "worker_cpus": 0.25, "worker_set": "inprocess", "shared_replicas": 1,
        "jobs": {"path": str(jobs_dir)},
        "auth": {"api_keys": [{"key": USER_KEY, "tenant": "user"}, {"key": ADMIN_KEY, "tenant": "ops", "admin": True}]},
        "models": [
            {"model": "tiny-flux2", "workers": 1, "wait_window_s": 0.05, "max_queue": 64,
             "templates": [{"width": 64, "height": 64, "steps": 2}]},
            {"model": "tiny-cogvideox", "workers": 1, "max_queue": 16,
             "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 8}]},
        ],
    }


def app_table(args: dict[str, Any]) -> PlanTable:
    from deployments.planning import machine_fingerprint
    from xema_ray.serving.config import ServeConfig

    cog = plan_entry(COG, latency_s=2.0, peak_bytes=16 * 10**6)
    cog = cog.model_copy(update={"config": cog.config.model_copy(update={"mitigations": (
        Mitigation(kind="vae_chunking", modules=("vae.decoder[up_blocks.2:]",), intensity=4),)})})
    return PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 1), gpus=1, budget_bytes=BUDGET,
                     entries={FLUX.shape_key: plan_entry(FLUX, latency_s=0.3, peak_bytes=3 * 10**6),
                              COG.shape_key: cog})


def chromium_path() -> str | None:
    """Debian's chromium (``apt-get install -y chromium``), or None."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@contextlib.contextmanager
def browser() -> Iterator[Any]:
    """A headless Chromium from the system binary (``executable_path``: Playwright downloads nothing)."""
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        raise RuntimeError("chromium is not installed (apt-get install -y chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()
