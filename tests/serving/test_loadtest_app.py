"""`make loadtest`'s handling of the app (loadtests/run.py) without Ray: it waits for readiness
through 503s, stops only the process session it started, and reads the URL from the config."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loadtests import run
from xema_ray.serving.api.ready import NotReady, ReadyPoll, wait_ready


class _Starting(http.server.BaseHTTPRequestHandler):
    """/healthz: 503 (starting) for the first ``starting`` looks, then 200."""

    looks = 0
    starting = 3

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).looks += 1
        ready = type(self).looks > type(self).starting
        body = json.dumps({"status": "ok" if ready else "starting"}).encode()
        self.send_response(200 if ready else 503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def starting_app():  # type: ignore[no-untyped-def]
    _Starting.looks = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Starting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_waiting_goes_through_a_starting_app_without_crashing(starting_app: str) -> None:
    log: list[ReadyPoll] = []
    wait_ready(starting_app, timeout_s=30, poll_s=0.01, log=log)
    assert [p.status for p in log] == [503, 503, 503, 200]
    assert [p.state for p in log][0] == "starting"


def test_waiting_gives_up_with_the_last_answer_or_when_the_app_exits(starting_app: str) -> None:
    _Starting.starting = 10**6
    try:
        with pytest.raises(NotReady, match="HTTP 503, starting"):
            wait_ready(starting_app, timeout_s=0.1, poll_s=0.01)
        with pytest.raises(RuntimeError, match="exited"):
            wait_ready(starting_app, timeout_s=30, poll_s=0.01, alive=lambda: False)
    finally:
        _Starting.starting = 3
    with pytest.raises(NotReady):
        wait_ready("http://127.0.0.1:9", timeout_s=0.05, poll_s=0.01)  # nothing listens: not yet, not a crash


def test_stop_app_ends_its_own_session_only(tmp_path: Path) -> None:
    # a stand-in for `serve run` and the cluster it starts: a process with a child in its session
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    ours = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        time.sleep(0.5)
        child = subprocess.run(["pgrep", "-s", str(ours.pid)], capture_output=True, text=True).stdout.split()
        assert len(child) == 2
        run.stop_app(ours)
        deadline = time.time() + 10
        while subprocess.run(["pgrep", "-s", str(ours.pid)], capture_output=True).returncode == 0:
            assert time.time() < deadline, "a process of the stopped session survived"
            time.sleep(0.1)  # killed; reaped a moment later
        assert theirs.poll() is None  # another session (another cluster) is untouched
    finally:
        theirs.kill()
    source = Path(run.__file__).read_text()
    assert '"stop"' not in source and "ray stop --force" not in source


def test_the_url_comes_from_the_config(tmp_path: Path) -> None:
    cfg = tmp_path / "app.yaml"
    cfg.write_text("http_options: {host: 0.0.0.0, port: 8291}\napplications: []\n")
    assert run.config_url(cfg) == "http://127.0.0.1:8291"
    assert run.config_url(Path(run.ROOT) / "deployments" / "xema.yaml") == "http://127.0.0.1:8000"


def test_templates_with_references_get_images_of_theirreference_size() -> None:
    """The load test sends what an image-edit or image-to-video template needs (as a client would):
    seeded noise of the template's reference size, the same bytes for every request of a size."""
    import io

    from PIL import Image

    from loadtests.references import reference_png, reference_size

    edit = {"width": 128, "height": 128, "references": 2, "reference_size": "64x48"}
    i2v = {"width": 64, "height": 64, "references": 1, "reference_size": None}
    assert reference_size(edit) == (64, 48) and reference_size(i2v) == (64, 64)
    img = Image.open(io.BytesIO(reference_png(64, 48)))
    assert img.format == "PNG" and img.size == (64, 48)
    assert reference_png(64, 48) == reference_png(64, 48) != reference_png(48, 64)
