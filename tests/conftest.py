"""Shared fixtures. CPU by default; tests marked ``gpu`` need CUDA and are skipped without it."""

from __future__ import annotations

import os

# A Serve handle's router keeps a metrics thread that outlives ``ray.shutdown()``; its next
# ``ray.wait`` would start a fresh local Ray in the pytest process (Ray's auto-init), and the next
# module's ``ray.init`` then fails with "called ray.init twice". Every fixture and the code under
# test call ``ray.init`` explicitly, so auto-init is off for the whole run (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by `make gpu-check` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: a folder named gpu matches that
            item.add_marker(skip)
