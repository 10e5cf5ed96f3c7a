"""The serving path under hostile input, overload and killed processes (a live Ray Serve app on
CPU, tiny models): every response is a 200 or a JSON error in one shape — 503s with Retry-After —
none is lost, and the app recovers. Also the OpenAPI document and a schemathesis fuzz against it.

One application for the module: tiny-flux2 64² planned at batch 2 on one worker (so concurrent
requests share batches) and tiny-cogvideox 64²×9 at batch 1 on one worker. Ray Serve's HTTP
proxy runs our JSON-error middleware (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``), as under
``make serve``. Recovery times are printed (``pytest -s``) and recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import requests

import ray
from bench.scenarios.serve_app import running_app
from ray import serve

from xema_ray.plan import PlanEntry, PlanTable
from xema_ray.serving.api.health import HEALTHZ_FRESH_S
from xema_ray.serving.config import ServeConfig
from deployments.planning import machine_fingerprint
from xema_ray.templates import RequestTemplate
from bench.scenarios.factories import plan_entry

pytestmark = pytest.mark.slow

FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
COG = RequestTemplate(model="tiny-cogvideox", width=64, height=64, frames=9, steps=2)
IMAGE = {"model": "tiny-flux2", "prompt": "a red fox", "size": "64x64"}
MAX_IN_FLIGHT = 24
RECOVERY: dict[str, float] = {}  # fault -> seconds from the kill to the next 200
OUTCOMES: dict[str, tuple[int, int]] = {}  # fault -> (200s, JSON 503s) of the requests in flight
T = TypeVar("T")


def _entry(t: RequestTemplate, batch: int = 1) -> PlanEntry:
    return plan_entry(t, batch=batch)


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    args = {
        "device": "cpu",
        "worker_cpus": 0.25,
        "limits": {"max_in_flight": MAX_IN_FLIGHT, "max_prompt_chars": 2000},
        "jobs": {"path": str(tmp_path_factory.mktemp("jobs"))},
        "models": [
            {"model": "tiny-flux2", "workers": 1, "wait_window_s": 0.3,
             "templates": [{"width": 64, "height": 64, "steps": 2}]},
            {"model": "tiny-cogvideox", "workers": 1, "templates": [{"width": 64, "height": 64, "frames": 9, "steps": 2}]},
        ],
    }
    table = PlanTable(hardware=machine_fingerprint(ServeConfig.model_validate(args), 1), gpus=1, budget_bytes=10**9,
                      entries={FLUX.shape_key: _entry(FLUX, batch=2), COG.shape_key: _entry(COG)})
    with running_app(args, table, tmp_path_factory.mktemp("plans")) as url:
        yield url
    if RECOVERY:
        print("\nrecovery seconds (kill -> next 200):", json.dumps({k: round(v, 1) for k, v in RECOVERY.items()}))
        print("in-flight outcomes (200, JSON 503):", json.dumps(OUTCOMES))


def _post(url: str, body: dict | bytes, path: str = "/v1/images/generations", timeout: float = 180,
          **kw) -> requests.Response:  # type: ignore[no-untyped-def]
    if isinstance(body, bytes):
        return requests.post(f"{url}{path}", data=body, timeout=timeout, **kw)
    return requests.post(f"{url}{path}", json=body, timeout=timeout, **kw)


def _assert_json_error(r: requests.Response, status: int | None = None) -> dict:
    if status is not None:
        assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    if r.status_code == 503:
        assert int(r.headers["Retry-After"]) >= 1
    return err


def _assert_answered(rs: list[requests.Response]) -> tuple[int, int]:
    """Every response a 200 or a JSON 503 with Retry-After; returns (ok, unavailable)."""
    for r in rs:
        assert r.status_code in (200, 503), (r.status_code, r.headers.get("content-type"), r.text[:300])
        if r.status_code == 503:
            _assert_json_error(r)
    return sum(r.status_code == 200 for r in rs), sum(r.status_code == 503 for r in rs)


def _burst(url: str, n: int, during: Callable[[], None] | None = None, body: Callable[[int], dict] | None = None,
           in_flight: int = 0) -> list[requests.Response]:
    """``n`` concurrent image requests; ``during`` runs once tiny-flux2's group holds at least
    ``in_flight`` of them (queued or running), so that a fault hits requests in flight."""
    with cf.ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(_post, url, body(i) if body else {**IMAGE, "seed": 1000 + i}) for i in range(n)]
        if during is not None:
            _wait_in_flight(in_flight)
            during()
        return [f.result() for f in futs]


def _wait_in_flight(n: int, timeout_s: float = 30) -> None:
    group = serve.get_deployment_handle("ModelGroup:tiny-flux2", app_name="xema")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        s = group.status.remote().result(timeout_s=10)
        if s["queued"] + 2 * s["running"] >= n:  # a running batch holds 2
            return
        time.sleep(0.05)
    raise AssertionError(f"never {n} requests in flight")


def _actors(class_prefix: str) -> list[dict]:
    import ray._private.state as state

    return [a for a in state.actors().values() if a["ActorClassName"].startswith(class_prefix) and a["State"] == "ALIVE"]


def _sigkill(class_prefix: str) -> str:
    """SIGKILL the one live actor process of this class (the fault: a process dies); returns its
    actor id, the fact the test then waits on (Ray marks that id dead; another id takes its place)."""
    (victim,) = _actors(class_prefix)  # one: the test started settled, with no dead actor still listed alive
    os.kill(victim["Pid"], signal.SIGKILL)
    return str(victim["ActorID"])


def _wait_for(what: str, fact: Callable[[], T | None], timeout_s: float = 240, poll_s: float = 0.1) -> T:
    """Poll ``fact`` until it returns a value (not None): a test waits on what it needs to be
    true, never for a fixed time. ``timeout_s`` only bounds a fault that never heals."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fact()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout_s} s")
        time.sleep(poll_s)


def _healthz(url: str) -> tuple[float, dict]:
    """(seconds /healthz took, its body)."""
    start = time.monotonic()
    r = requests.get(f"{url}/healthz", timeout=30)
    return time.monotonic() - start, r.json()


def _serve_settled() -> bool:
    """Serve's controller: the app RUNNING, each deployment HEALTHY with every replica RUNNING;
    and Ray: as many live replica actors of each deployment as it has RUNNING (a killed one is
    no longer listed alive, so the next ``_sigkill`` finds the one to kill)."""
    app = serve.status().applications.get("xema")
    if app is None or str(app.status.value) != "RUNNING":
        return False
    for name, d in app.deployments.items():
        states = {str(getattr(k, "value", k)): n for k, n in d.replica_states.items()}
        if str(d.status.value) != "HEALTHY" or set(states) != {"RUNNING"}:
            return False
        replica = f"ServeReplica:xema:{name}"
        if sum(a["ActorClassName"] == replica for a in _actors(replica)) != states["RUNNING"]:
            return False
    return True


def _settle(url: str, since: float, dead: tuple[str, ...] = (),
            group: Callable[[dict], bool] = lambda g: True) -> dict:
    """Wait until the app is whole again after a fault at ``since`` (``time.time()``) and return
    ``/healthz``'s body: every actor id in ``dead`` known dead to Ray, Serve's replicas all
    RUNNING, ``/healthz`` 200 with every group ``ok``, its last answer given after the fault, and
    idle (no request of this test left in it), and ``group`` true of tiny-flux2's answer. The next
    test then starts from the state the module started in."""
    import ray._private.state as state

    def whole() -> dict | None:
        if any(state.actors().get(a, {}).get("State") == "ALIVE" for a in dead) or not _serve_settled():
            return None
        r = requests.get(f"{url}/healthz", timeout=30)
        h = r.json()
        fresh = time.time() - since
        if r.status_code != 200 or h["status"] != "ok" or not group(h["groups"]["tiny-flux2"]):
            return None
        for g in h["groups"].values():
            if g["answered_s_ago"] is None or g["answered_s_ago"] >= fresh or g["queued"] + g["running"] + g["paused"]:
                return None
        return h

    return _wait_for("the app whole again (Serve RUNNING, every group ok and idle)", whole)


@pytest.fixture
def settled(server: str) -> dict:
    """A fault test starts from a whole app (nothing left over from the test before); its
    ``/healthz`` body."""
    return _settle(server, since=time.time())


def _recovery(url: str, since: float, name: str, timeout_s: float = 240,
              outcome: tuple[int, int] | None = None) -> float:
    """Seconds from ``since`` until a fresh request gets a 200 (each failure a JSON 503, and the
    next try made at once: the 503 itself is the fact that it is not back yet)."""
    if outcome is not None:
        OUTCOMES[name] = outcome
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        r = _post(url, {**IMAGE, "seed": 7})
        if r.status_code == 200:
            RECOVERY[name] = time.time() - since
            return RECOVERY[name]
        _assert_json_error(r, 503)
        time.sleep(0.5)  # a poll, not a wait for the fault: spaces the 503s a down group answers at once
    raise AssertionError(f"{name}: no 200 within {timeout_s} s")


# ---------------------------------------------------------------------------- ports
def test_every_port_of_the_cluster_listens_on_localhost_only(server: str) -> None:
    import psutil

    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listening) >= 5, listening  # GCS, raylet, workers, replicas, proxy, agents
    # the Serve replicas' inter-deployment gRPC servers included: Ray Serve 2.60 binds them to
    # "[::]:0", and every deployment of the app rebinds them to the node address first
    # (xema_ray/serving/replica_bind.py; docs/serving.md "Ports")
    exposed = [x for x in listening if x[0] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert exposed == [], exposed
    replicas = [x for x in listening if any(part.startswith("ray::ServeReplica") for part in psutil.Process(x[2]).cmdline())]
    assert len(replicas) >= 4, listening  # Router, Stats, two ModelGroups: one gRPC server each, on loopback


# ---------------------------------------------------------------------------- OpenAPI + fuzz
def test_openapi_enumerates_models_sizes_and_statuses(server: str) -> None:
    doc = requests.get(f"{server}/openapi.json", timeout=30).json()
    props = doc["components"]["schemas"]["ImageRequest"]["properties"]
    assert props["model"]["enum"] == ["tiny-flux2"] and props["size"]["enum"] == ["64x64"]
    assert props["prompt"]["maxLength"] == 2000
    responses = doc["paths"]["/v1/images/generations"]["post"]["responses"]
    assert {"200", "400", "413", "415", "422", "500", "503"} <= set(responses)


def test_fuzz_finds_no_server_error_and_no_undocumented_status(server: str) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.NEGATIVE and op.method.lower() != "post":
                continue  # GETs take no input to get wrong

            @settings(max_examples=12, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:  # type: ignore[no-untyped-def]
                response = case.call(base_url=server, timeout=180)
                seen.setdefault(label, set()).add(response.status_code)
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                         content_type_conformance, negative_data_rejection])

            fuzz()
    # no group of this app serves adapters: every adapter a fuzzer can name is refused by name (422), none loads
    assert seen.get("POST /v1/adapters", {422}) <= {400, 403, 413, 415, 422}, seen
    posts = {k: v for k, v in seen.items() if k.startswith("POST") and k != "POST /v1/adapters"}
    assert posts and all(200 in v or 400 in v for v in posts.values()), seen  # valid requests were built
    assert any(422 in v for v in posts.values()), seen  # and invalid ones refused by name
    print("\nfuzz statuses:", {k: sorted(v) for k, v in seen.items()})


# ---------------------------------------------------------------------------- bad inputs
def test_a_poisoned_request_fails_alone(server: str) -> None:
    poison = {**IMAGE, "seed": 2**63 - 1, "n": 2}  # the report's request: seed + 1 overflows

    def body(i: int) -> dict:
        return poison if i % 4 == 0 else {**IMAGE, "seed": 50 + i}

    for _ in range(2):
        rs = _burst(server, 8, body=body)
        for i, r in enumerate(rs):
            if i % 4 == 0:
                assert "seed" in _assert_json_error(r, 422)["message"]
            else:
                assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_error_raised_if_guidance_is_not_finite(server: str, value: str) -> None:
    body = json.dumps(IMAGE)[:-1] + f', "guidance_scale": {value}}}'
    r = _post(server, body.encode(), headers={"content-type": "application/json"})
    assert _assert_json_error(r, 422)["param"] == "guidance_scale"


def test_error_raised_if_body_or_fields_are_too_large(server: str) -> None:
    r = _post(server, {**IMAGE, "user": "u" * (16 * 2**20)})
    assert _assert_json_error(r, 413)["code"] == "body_too_large"
    r = _post(server, {**IMAGE, "prompt": "p" * 100_000})
    err = _assert_json_error(r, 422)
    assert err["param"] == "prompt" and len(r.content) < 1000
    assert _assert_json_error(_post(server, {**IMAGE, "style": "s" * 1000}), 422)["param"] == "style"


@pytest.mark.parametrize(("ctype", "body"), [
    ("text/plain", json.dumps(IMAGE).encode()),
    ("application/xml", b"<model>tiny-flux2</model>"),  # forms are accepted: validation.py, as on every endpoint
])
def test_error_raised_if_body_is_not_json(server: str, ctype: str, body: bytes) -> None:
    err = _assert_json_error(_post(server, body, headers={"content-type": ctype}), 415)
    assert "application/json" in err["message"]


def test_unknown_template_names_the_field(server: str) -> None:
    err = _assert_json_error(_post(server, {**IMAGE, "size": "96x96"}), 400)
    assert err["param"] == "size" and err["supported_templates"] == [FLUX.shape_key]


# ---------------------------------------------------------------------------- overload
def test_overload_gets_json_503_with_retry_after(server: str) -> None:
    rs = _burst(server, 3 * MAX_IN_FLIGHT)
    ok, busy = _assert_answered(rs)
    assert ok >= 1 and busy >= 1 and ok + busy == len(rs)


# ---------------------------------------------------------------------------- faults
def _rebuilt_since(before: dict) -> Callable[[dict], bool]:
    """tiny-flux2's group built a new worker set since ``before`` (a ``/healthz`` body)."""
    return lambda g: g["generation"] > before["groups"]["tiny-flux2"]["generation"]


def test_killed_worker_with_requests_in_flight(server: str, settled: dict) -> None:
    group = serve.get_deployment_handle("ModelGroup:tiny-flux2", app_name="xema")
    t0: list[float] = []
    rs = _burst(server, 16, during=lambda: (t0.append(time.time()), group.kill_worker.remote(0).result()),
                in_flight=8)
    ok, unavailable = _assert_answered(rs)
    _recovery(server, t0[0], "worker", outcome=(ok, unavailable))
    assert ok + unavailable == 16
    # the fact: the group built a new worker set (and the next test finds it whole)
    _settle(server, t0[0], group=_rebuilt_since(settled))


def test_killed_model_group_replica_with_requests_in_flight(server: str, settled: dict) -> None:
    t0: list[float] = []
    killed: list[str] = []
    health: list[tuple[float, dict]] = []
    old_owner = settled["groups"]["tiny-flux2"]["owner"]

    def degraded() -> dict | None:
        seconds, h = _healthz(server)
        health.append((seconds, h))
        return h if h["groups"]["tiny-flux2"]["status"] != "ok" else None

    def kill() -> None:
        t0.append(time.time())
        killed.append(_sigkill("ServeReplica:xema:ModelGroup:tiny-flux2"))
        # until a probe meets the death (its call raises, or Serve reports no running replica),
        # /healthz reports the group's last answer: "ok" then is a slow fact, not a wrong one
        _wait_for("/healthz reporting tiny-flux2 degraded", degraded, timeout_s=120)

    rs = _burst(server, 16, during=kill, in_flight=8)
    ok, unavailable = _assert_answered(rs)
    assert ok + unavailable == 16
    # /healthz does not wait for the dead group: each answer within its freshness wait (a
    # replacement replica takes 15 s or more here), however long the death took to be seen
    slowest = max(seconds for seconds, _ in health)
    assert slowest < HEALTHZ_FRESH_S + 2.0, slowest
    h = health[-1][1]
    assert h["status"] == "degraded" and h["degraded"] == ["tiny-flux2"], h
    assert h["groups"]["tiny-flux2"]["status"] == "degraded" and h["groups"]["tiny-flux2"]["accepting"] is False, h
    assert h["groups"]["tiny-cogvideox"]["status"] == "ok"
    _recovery(server, t0[0], "model_group_replica", outcome=(ok, unavailable))
    # whole again: the killed actor dead to Ray, a new replica RUNNING and answering the probes
    _settle(server, t0[0], dead=tuple(killed), group=lambda g: g["owner"] != old_owner)


def test_killed_router_with_requests_in_flight_keeps_the_counters(server: str, settled: dict) -> None:
    before = requests.get(f"{server}/v1/stats", timeout=30).json()["received"]
    t0: list[float] = []
    killed: list[str] = []
    rs = _burst(server, 16, during=lambda: (t0.append(time.time()),
                                            killed.append(_sigkill("ServeReplica:xema:Router"))), in_flight=8)
    ok, unavailable = _assert_answered(rs)
    assert ok + unavailable == 16
    _recovery(server, t0[0], "router", outcome=(ok, unavailable))
    after = requests.get(f"{server}/v1/stats", timeout=30).json()["received"]
    assert after >= before + 1, (before, after)  # kept by the Stats deployment, not restarted from 0
    _settle(server, t0[0], dead=tuple(killed))  # a new Router actor answers /healthz


def test_worker_killed_while_its_replacement_is_built(server: str, settled: dict) -> None:
    group = serve.get_deployment_handle("ModelGroup:tiny-flux2", app_name="xema")
    old = {a["Pid"] for a in _actors("Worker")}
    killed: list[int] = []
    stop = threading.Event()

    def kill_the_replacement() -> None:
        # the first new Worker process is the replacement being built: kill it before it is ready
        while not stop.is_set():
            new = [a for a in _actors("Worker") if a["Pid"] not in old]
            if new:
                os.kill(new[0]["Pid"], signal.SIGKILL)
                killed.append(new[0]["Pid"])
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_the_replacement, daemon=True)
    watcher.start()
    t0 = time.time()
    group.kill_worker.remote(0).result()  # the next batch fails and starts the rebuild
    rs = _burst(server, 8)
    stop.set()
    watcher.join(timeout=5)
    ok, unavailable = _assert_answered(rs)
    assert killed, "no replacement worker was seen"
    _recovery(server, t0, "worker_during_rebuild", outcome=(ok, unavailable))
    # the group rebuilt past both deaths and says ok (its status, asked after the faults)
    _settle(server, t0, group=_rebuilt_since(settled))
