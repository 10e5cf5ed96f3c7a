"""A real redis-server for tests, on a free port, in a temporary folder (CI installs the binary)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from xema_ray.net import free_port


@contextmanager
def redis_server() -> Iterator[str]:
    """Start redis-server, yield its URL, stop it. Skips when the binary is absent."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run installs it)")
    import redis
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            client = redis.Redis.from_url(url)
            deadline = time.time() + 20
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.time() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"redis-server did not start on port {port}") from None
                    time.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)
