"""Shared fixtures. CPU by default; tests marked ``gpu`` need CUDA and are skipped without it."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by `make gpu-check` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: a folder named gpu matches that
            item.add_marker(skip)
