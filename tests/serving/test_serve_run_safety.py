"""`serve run deployments/<any>.yaml` gets the proxy's JSON errors from the file itself, and the
commands that start Ray (`xema serve`, `make serve*`) give it 127.0.0.1-only ports and the same
errors from the cluster's environment; an app built on a cluster whose ports are open says so. No
Ray cluster needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from xema_ray.serving import ray_env
from xema_ray.serving.api.middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "deployments").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_installs_the_json_proxy_middleware(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    cfg = ServeDeploySchema.model_validate(raw)  # what `serve run` validates before it starts Ray
    assert cfg.controller_options is not None and cfg.controller_options.runtime_env is not None
    # the controller's env reaches the HTTP proxy it creates, where Serve reads the callback
    assert cfg.controller_options.runtime_env["env_vars"][PROXY_CALLBACK_ENV] == PROXY_CALLBACK
    assert cfg.http_options.host == "127.0.0.1"  # the API itself binds loopback unless edited
    header = path.read_text().splitlines()[0]
    assert "xema serve" in header or "make serve" in header  # the header names the safe command


def test_every_make_target_that_serves_sets_the_ray_environment() -> None:
    make = (ROOT / "Makefile").read_text()
    serving = [line for line in make.splitlines() if re.search(r"\bserve run\b|xema serve", line) and line.startswith("\t")]
    assert len(serving) >= 2 and all("xema serve" in line for line in serving), serving


def test_ray_env_makes_ports_local_unless_opened() -> None:
    env = ray_env.ray_env(open_ports=False, base={})
    assert env[ray_env.LOCAL_ONLY_ENV] == "0" and env[PROXY_CALLBACK_ENV] == PROXY_CALLBACK
    assert ray_env.LOCAL_ONLY_ENV not in ray_env.ray_env(base={ray_env.OPEN_PORTS_ENV: "1"})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_xema_serve_drops_the_controller_options_its_cluster_environment_sets(
        path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A runtime environment on Serve's controller makes every process Serve starts a fresh one:
    where the cluster ``serve run`` starts has the proxy's variable already, ``xema serve`` hands
    it the same config without the block (and the proxy still gets its middleware from the
    environment); never where ``serve run`` may attach to a cluster started elsewhere."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    env = ray_env.ray_env(open_ports=False, base={})
    served = ray_env.serve_run_config(str(path), env)
    assert served != str(path) and Path(served).parent == tmp_path
    original, derived = yaml.safe_load(path.read_text()), yaml.safe_load(Path(served).read_text())
    assert derived == {k: v for k, v in original.items() if k != "controller_options"}
    ServeDeploySchema.model_validate(derived)  # what `serve run` validates
    assert env[PROXY_CALLBACK_ENV] == PROXY_CALLBACK  # ... the proxy's middleware from the cluster's environment
    assert ray_env.serve_run_config(str(path), env) == served  # one file per content, written once
    assert len(list(tmp_path.iterdir())) == 1
    # kept as written where the cluster is not the one started with env
    assert ray_env.serve_run_config(str(path), env, ["--address", "auto"]) == str(path)
    assert ray_env.serve_run_config(str(path), env, ["--address=ray://h:10001"]) == str(path)
    assert ray_env.serve_run_config(str(path), {**env, "RAY_ADDRESS": "auto"}) == str(path)
    assert ray_env.serve_run_config(str(path), {**env, PROXY_CALLBACK_ENV: "other:callback"}) == str(path)


def test_xema_serve_keeps_controller_options_that_hold_more(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "deployments" / "xema.yaml").read_text())
    env = ray_env.ray_env(open_ports=False, base={})
    more = {**raw, "controller_options": {"runtime_env": {"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK},
                                                          "pip": ["x"]}}}
    (tmp_path / "more.yaml").write_text(yaml.safe_dump(more))
    assert ray_env.serve_run_config(str(tmp_path / "more.yaml"), env) == str(tmp_path / "more.yaml")
    assert ray_env.serve_run_config(str(tmp_path / "missing.yaml"), env) == str(tmp_path / "missing.yaml")


def test_an_app_on_a_cluster_with_open_ports_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.delenv(ray_env.OPEN_PORTS_ENV, raising=False)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.7")
    warning = ray_env.exposed_ports_warning()
    assert warning is not None and "192.0.2.7" in warning and "xema serve" in warning
    monkeypatch.setenv(ray_env.OPEN_PORTS_ENV, "1")  # opened on purpose: nothing to say
    assert ray_env.exposed_ports_warning() is None
    monkeypatch.delenv(ray_env.OPEN_PORTS_ENV)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    assert ray_env.exposed_ports_warning() is None


def test_a_local_ray_whose_raylet_missed_registration_is_started_again_after_its_leftovers_die(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    import psutil
    import ray

    calls: list[dict] = []
    leftovers: list[subprocess.Popen] = []

    def init(**kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        if len(calls) == 1:  # the failed start leaves its GCS and raylet running
            leftovers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    ray_env.init_local_ray(num_cpus=4, pause_s=0.0)
    assert calls == [{"num_cpus": 4}, {"num_cpus": 4}]
    assert not psutil.pid_exists(leftovers[0].pid)  # killed and reaped before the second start (it sleeps 60 s)


def test_a_local_ray_start_that_fails_otherwise_or_every_time_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    calls: list[str] = []

    def init(why: str):  # type: ignore[no-untyped-def]
        def run(**kwargs):  # type: ignore[no-untyped-def]
            calls.append(why)
            raise Exception(why)
        return run

    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "init", init("called ray.init twice"))
    with pytest.raises(Exception, match="twice"):
        ray_env.init_local_ray(pause_s=0.0)
    assert calls == ["called ray.init twice"]  # not a start that timed out: no second try
    calls.clear()
    monkeypatch.setattr(ray, "init", init("The current node timed out during startup."))
    with pytest.raises(Exception, match="timed out during startup"):
        ray_env.init_local_ray(attempts=3, pause_s=0.0)
    assert len(calls) == 3
