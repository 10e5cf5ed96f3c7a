"""A sub-batch whose failure the worker pins on some of its requests (``RequestFailed``: their own
input) runs again without them, so that one request's input never fails its batch neighbours.
The pinned requests get ``InvalidRequest`` (HTTP 422, naming the problem and the field)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from xema_ray.runtime.request_errors import failed_requests
from xema_ray.scheduling.batch import Pending
from xema_ray.serving.group.messages import InvalidRequest

P = TypeVar("P")


async def run_isolating(reqs: list[Pending[P]], run: Callable[[list[Pending[P]], bool], Awaitable[None]]
                        ) -> dict[str, InvalidRequest]:
    """``run(reqs, rerun)`` until it succeeds, each time without the requests the last failure was
    pinned on; returns those requests' errors. A failure pinned on none of ``reqs`` is raised.

    Args:
        reqs: the sub-batch's requests.
        run: runs a sub-batch (``rerun``: its requests ran before, e.g. their jobs are started).
    """
    failed: dict[str, InvalidRequest] = {}
    rerun = False
    while reqs:
        try:
            await run(reqs, rerun)
            break
        except Exception as e:
            blamed = failed_requests(e)
            hit = set(blamed.request_ids) & {r.request_id for r in reqs} if blamed is not None else set()
            if blamed is None or not hit:
                raise
            for rid in hit:
                failed[rid] = InvalidRequest(str(blamed), blamed.param)
            reqs = [r for r in reqs if r.request_id not in hit]
            rerun = True
    return failed
