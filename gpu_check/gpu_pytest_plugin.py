"""pytest plugin of `gpu_check/run.py` (loaded with ``-p gpu_pytest_plugin``): appends one JSON
line per event to the file named by ``$XEMA_GPU_REPORT`` as it happens, so a test process that
segfaults or hangs still leaves what it collected and which phases it finished.

Lines: ``{"kind": "collected", "nodeid", "gpu", "marker"}`` per selected test (``marker``: the ``gpu``
marker's keyword arguments, the figures a test gives the check's plan: gpu_check/gpu_plan.py), ``{"kind": "collect_error",
"nodeid", "message"}`` per module that failed to import, ``{"kind": "phase", "nodeid", "when",
"outcome", "duration", "message"}`` per setup / call / teardown report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

MESSAGE_CHARS = 4000


def _write(line: dict[str, Any]) -> None:
    path = os.environ.get("XEMA_GPU_REPORT")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:  # open-append-close: on disk before the next event
        f.write(json.dumps(line) + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"kind": "collect_error", "nodeid": report.nodeid,
                "message": str(report.longrepr)[-MESSAGE_CHARS:]})


def _runnable_id(item: pytest.Item, rootdir: Path) -> str:
    """The item's node id with a path pytest can be given back: a module outside the rootdir
    (a rehearsal's planted tests) has an id without one (``::test_x``)."""
    path = Path(item.path)
    where = str(path.relative_to(rootdir)) if path.is_relative_to(rootdir) else str(path)
    return f"{where}::{item.nodeid.split('::', 1)[1]}" if "::" in item.nodeid else where


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        mark = item.get_closest_marker("gpu")
        _write({"kind": "collected", "nodeid": _runnable_id(item, Path(session.config.rootpath)),
                "gpu": mark is not None, "marker": _jsonable(dict(mark.kwargs)) if mark is not None else {}})


def _jsonable(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in kwargs.items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    message = None
    if report.longrepr is not None:
        # a skip's longrepr is (file, line, reason): the reason is what a reader needs
        message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)[-MESSAGE_CHARS:]
    _write({"kind": "phase", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": report.duration, "message": message})
