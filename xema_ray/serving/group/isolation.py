"""One request's input never fails its batch neighbours: a sub-batch that fails runs again without
the requests at fault, and the others are served (``run_isolating``).

The requests at fault are found in one of two ways:

- **named**: the worker pins the failure on some requests (``RequestFailed``: a prompt its encoder
  cannot take, an option the pipeline refuses). They get ``InvalidRequest`` (HTTP 422 naming the
  problem and the field); the others run again without them.
- **split**: any other failure that is not the machine's (``is_fault``) runs again in parts —
  halves (bisection) or one request each, whichever the plan predicts cheaper (``split_in``) —
  until every request has been served or has failed alone (in a sub-batch of its own).

A request that failed alone is answered by this rule:

- none of the sub-batch's requests was served: nothing tells its input from the server, so each
  gets the error as it was raised (what the whole batch got before the split: a 500 for a bug);
- else a ``ValueError`` or ``TypeError`` (what a pipeline raises on an input it refuses) is its
  own input's: ``InvalidRequest`` (HTTP 422, no ``param``: the pipeline does not say which field),
  the message quoting the error;
- else (any other error: a bug that its input alone triggers) ``RequestFailedAlone`` (HTTP 500
  naming the request).

The machine's failures are never split: out of device memory (its own path, a JSON 503 and the
template's out-of-memory count), a worker or actor that died (the group rebuilds and retries the
batch), a cancelled batch, a group that is unavailable, any Ray system error. They fail the batch
as before.

Every run after a failure runs fewer requests than the run that failed, so a sub-batch of ``n``
runs at most ``2n - 1`` times (every request failing alone under bisection). Each re-run is logged
and reported to ``on_rerun`` (the group counts ``xema_batch_reruns`` and tells the dispatcher how
much longer the batch holds its workers).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from xema_ray.runtime.request_errors import failed_requests
from xema_ray.scheduling.batch import Pending
from xema_ray.serving.messages import GroupUnavailable, InvalidRequest, QueueFull, RequestFailedAlone
from xema_ray.serving.group.worker_set import RebuildFailed, WorkerDied

P = TypeVar("P")
logger = logging.getLogger("xema_ray.serving")

#: why a sub-batch runs again: the worker named requests at fault, or nothing named one (split)
RerunReason = Literal["named", "split"]
#: characters of a pipeline's error quoted in a 422
QUOTE_ERROR_CHARS = 300
#: message fragments of an allocation failure that did not become ``DeviceOutOfMemory``
_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and what it wraps (a Ray error's ``cause``, ``__cause__``)."""
    out = [e]
    for inner in (getattr(e, "cause", None), e.__cause__):
        if isinstance(inner, BaseException) and inner not in out:
            out.append(inner)
    return out


def is_fault(e: BaseException) -> bool:
    """Whether ``e`` is the machine's failure rather than an input's: out of memory, a dead
    worker or actor, a cancelled batch, the group unavailable, a Ray system error."""
    from ray.exceptions import RayError, RayTaskError

    from xema_ray.runtime.progress import BatchCancelled

    for x in _chain(e):
        if isinstance(x, MemoryError | WorkerDied | RebuildFailed | GroupUnavailable | QueueFull | BatchCancelled):
            return True  # DeviceOutOfMemory is a MemoryError
        if isinstance(x, RayError) and not isinstance(x, RayTaskError):
            return True  # an actor or node died, an object was lost, a call timed out
        if type(x).__name__ == "OutOfMemoryError" or any(w in str(x).lower() for w in _OOM_WORDS):
            return True  # torch's own, where the worker did not make it a DeviceOutOfMemory
    return False


def _cause(e: BaseException) -> BaseException:
    """The error a worker raised (a Ray error's text is its traceback; its ``cause`` is the error)."""
    seen = {id(e)}
    while isinstance(inner := getattr(e, "cause", None), BaseException) and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    return e


def _own_input(e: BaseException) -> bool:
    """A ``ValueError`` or ``TypeError`` as the worker raised it (what a pipeline raises on an input it refuses)."""
    return isinstance(e, ValueError | TypeError) or isinstance(_cause(e), ValueError | TypeError)


def split_in(n: int, cost: Callable[[int], float]) -> int:
    """How many parts a failed sub-batch of ``n`` (no request named) runs again in: 2 (halves,
    then the failing half split the same way) or ``n`` (one request each), whichever the predicted
    seconds of a sub-batch of k (``cost(k)``) make cheaper for finding one request at fault. Ties
    go to one each (fewer rounds).

    Example:
        >>> split_in(8, lambda k: 1.0), split_in(8, lambda k: float(k)), split_in(3, lambda k: 1.0)
        (2, 8, 3)
    """
    @functools.cache
    def find(k: int) -> float:  # predicted seconds to find one request at fault among k
        if k <= 1:
            return 0.0
        return min(_halves_s(k), k * cost(1))

    def _halves_s(k: int) -> float:
        big = math.ceil(k / 2)
        return cost(big) + cost(k - big) + find(big)

    return 2 if n > 2 and _halves_s(n) < n * cost(1) else n


def _parts(reqs: list[Pending[P]], k: int) -> list[list[Pending[P]]]:
    if k == 2:
        big = math.ceil(len(reqs) / 2)
        return [reqs[:big], reqs[big:]]
    return [[r] for r in reqs]


def _answer(rid: str, e: Exception, neighbours_served: bool) -> Exception:
    """What a request that failed alone is answered with (the module docstring's rule)."""
    if not neighbours_served:
        return e
    c = _cause(e)
    if _own_input(e):
        text = str(c)
        if len(text) > QUOTE_ERROR_CHARS:
            text = text[:QUOTE_ERROR_CHARS] + f"... ({len(text)} characters)"
        return InvalidRequest(f"the request failed inside its batch and again alone, on its own input "
                              f"({type(c).__name__}: {text}); its batch neighbours were served", None)
    return RequestFailedAlone(f"request {rid} failed inside its batch and again alone ({type(c).__name__}); its "
                              "batch neighbours were served; this is a bug, please report it", rid)


def _after_failure(e: Exception, part: list[Pending[P]], cost: Callable[[int], float], named: dict[str, Exception],
                   alone: dict[str, Exception], label: str) -> tuple[RerunReason, list[list[Pending[P]]]]:
    """What a failed sub-batch runs again as (and the requests it leaves at fault, recorded)."""
    blamed = failed_requests(e)
    hit = set(blamed.request_ids) & {r.request_id for r in part} if blamed is not None else set()
    if blamed is not None and hit:
        for rid in hit:
            named[rid] = InvalidRequest(str(blamed), blamed.param)
        rest = [r for r in part if r.request_id not in hit]
        return "named", [rest] if rest else []
    if len(part) == 1:
        c = _cause(e)
        logger.warning("%s: request %s failed alone (%s: %s)", label, part[0].request_id, type(c).__name__, c)
        alone[part[0].request_id] = e
        return "split", []
    parts = _parts(part, split_in(len(part), cost))
    c = _cause(e)
    logger.warning("%s: a sub-batch of %d failed with no request named (%s: %s); running it again as %d "
                   "sub-batches", label, len(part), type(c).__name__, c, len(parts))
    return "split", parts


async def run_isolating(reqs: list[Pending[P]], run: Callable[[list[Pending[P]], bool], Awaitable[bool | None]],
                        cost: Callable[[int], float] = lambda k: 1.0,
                        on_rerun: Callable[[RerunReason, int, float], None] | None = None,
                        label: str = "batch") -> dict[str, Exception]:
    """Run ``reqs`` with ``run``, a failure not the machine's run again without the requests at
    fault (see the module docstring); returns what each request at fault is answered with. The
    machine's failures (``is_fault``) are raised.

    Args:
        reqs: the sub-batch's requests.
        run: runs a sub-batch (``rerun``: its requests ran before, e.g. their jobs are started);
            returns False when it served nobody (every member dropped meanwhile), else True or None.
        cost: predicted seconds of a sub-batch of k (chooses halves or one each: ``split_in``).
        on_rerun: told before each re-run: why, how many sub-batches are about to run again, and
            the predicted seconds of all the runs now pending.
        label: names the sub-batch in logs.
    """
    pending: list[list[Pending[P]]] = [reqs]  # a stack: the next run last
    named: dict[str, Exception] = {}
    alone: dict[str, Exception] = {}
    served = ran = False
    while pending:
        part = pending.pop()
        try:
            did = await run(part, ran)
        except Exception as e:
            blamed = failed_requests(e)
            if (blamed is None or not {r.request_id for r in part} & set(blamed.request_ids)) and is_fault(e):
                raise  # a failure the worker names requests for is theirs, whatever caused it
            reason, parts = _after_failure(e, part, cost, named, alone, label)
            if parts:
                pending.extend(reversed(parts))
                if on_rerun is not None:
                    on_rerun(reason, len(parts), sum(cost(len(p)) for p in pending))
        else:
            served = served or did is not False
        ran = True
    return {**named, **{rid: _answer(rid, e, served) for rid, e in alone.items()}}
