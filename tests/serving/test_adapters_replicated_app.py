"""Integration: hot-added adapters on a model group of two replicas (Ray Serve on CPU, tiny-flux2).

``POST /v1/adapters`` reaches one replica; every replica serves the adapter once the call has
answered 201, and none serves it once ``DELETE`` has answered (the app's ``AdapterRegistry``).
Requests sent together spread over both replicas (``X-Xema-Replica``), so each is seen serving.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.scenarios.factories import plan_entry
from bench.scenarios.serve_app import running_app
from deployments.planning import machine_fingerprint
from xema_ray.lora.synthetic import write_adapter
from xema_ray.models import BuildOptions, get_model_spec
from xema_ray.plan import PlanTable
from xema_ray.serving.config import ServeConfig
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.slow

T = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
#: requests sent at once per round: more than one replica's batch, so both replicas take some
BURST = 8


@pytest.fixture(scope="module")
def app(tmp_path_factory):  # type: ignore[no-untyped-def]
    folder, hot = tmp_path_factory.mktemp("adapters"), tmp_path_factory.mktemp("hot")
    dit = get_model_spec("tiny-flux2").build_pipeline(BuildOptions(device="meta")).transformer  # shapes only
    write_adapter(folder / "A.safetensors", dit, rank=4, seed=1)
    c = write_adapter(hot / "c.safetensors", dit, rank=4, seed=3, layout="ai-toolkit-flux2")
    args = {
        "device": "cpu", "worker_cpus": 0.25, "jobs": {"path": str(tmp_path_factory.mktemp("jobs"))},
        "models": [{"model": "tiny-flux2", "workers": 1, "replicas": 2, "wait_window_s": 0.05, "max_queue": 16,
                    "templates": [{"width": 64, "height": 64, "steps": 2}],
                    "adapters": {"dir": str(folder), "roots": [str(folder), str(hot)], "slots": 2, "max_rank": 8}}],
    }
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 2), gpus=2, budget_bytes=10**9,
                      entries={T.shape_key: plan_entry(T, batch=1)})
    with running_app(args, table, tmp_path_factory.mktemp("plans")) as url:
        yield url, c


def _burst(url: str, lora: list[dict] | None) -> list[requests.Response]:
    body = {"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64", "seed": 3,
            **({"lora": lora} if lora is not None else {})}
    with ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(lambda _: requests.post(f"{url}/v1/images/generations", json=body, timeout=180),
                             range(BURST)))


def test_a_hot_added_adapter_is_served_by_every_replica_then_by_none(app) -> None:  # type: ignore[no-untyped-def]
    url, c = app
    replicas: set[str] = set()
    for _ in range(5):  # both replicas take part of a burst (the router sends each where it finishes first)
        got = _burst(url, None)
        assert all(r.status_code == 200 for r in got), [r.text for r in got]
        replicas |= {r.headers["X-Xema-Replica"] for r in got}
        if len(replicas) == 2:
            break
    assert len(replicas) == 2, replicas

    r = requests.post(f"{url}/v1/adapters", json={"name": "C", "model": "tiny-flux2", "path": str(c)}, timeout=120)
    assert r.status_code == 201, r.text
    again = requests.post(f"{url}/v1/adapters", json={"name": "C", "model": "tiny-flux2", "path": str(c)}, timeout=120)
    assert again.status_code == 409, again.text  # whichever replica it reached

    served: dict[str, set[str]] = {}
    for _ in range(5):
        for resp in _burst(url, [{"name": "C", "scale": 1.0}]):
            assert resp.status_code == 200, resp.text  # on whichever replica it ran
            served.setdefault(resp.headers["X-Xema-Replica"], set()).add(resp.json()["data"][0]["b64_json"])
        if len(served) == 2:
            break
    assert set(served) == replicas
    assert len({b for images in served.values() for b in images}) == 1  # the same request, the same bytes everywhere

    gone = requests.delete(f"{url}/v1/adapters/A", timeout=120)  # the YAML folder's, deleted at run time
    assert gone.status_code == 200 and gone.json()["models"] == ["tiny-flux2"], gone.text
    assert requests.delete(f"{url}/v1/adapters/C", timeout=120).status_code == 200
    for lora in ("A", "C"):
        refused = _burst(url, [{"name": lora, "scale": 1.0}])
        assert all(r.status_code == 404 and f"unknown adapter '{lora}'" in r.text for r in refused), \
            [(r.status_code, r.text[:200]) for r in refused]
