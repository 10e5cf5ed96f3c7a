"""The SLO request router reads a group call's template from its one typed request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from xema_ray.serving.messages import GroupRequest
from xema_ray.serving.scale.replica_router import request_template

REQ = GroupRequest(template="tiny-flux2-64x64-s2", request_id="r1", prompt="a fox", seed=1, steps=2)


def _pending(method: str, *args: Any, **kwargs: Any) -> Any:
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=args, kwargs=kwargs)


def test_generate_and_submit_job_are_routed_by_their_request_template() -> None:
    assert request_template(_pending("generate", REQ)) == REQ.template
    assert request_template(_pending("submit_job", REQ)) == REQ.template
    assert request_template(_pending("generate", req=REQ)) == REQ.template


def test_other_calls_have_no_template() -> None:
    assert request_template(None) is None
    assert request_template(_pending("status")) is None
    assert request_template(_pending("estimate", "tiny-flux2-64x64-s2")) is None
