"""What the Router's answers carry besides their bodies: the OpenAPI ``responses`` of each endpoint
(its error statuses and media types) and the ``X-Xema-*`` headers saying how a request ran."""

from __future__ import annotations

import time
from typing import Any

from xema_ray.serving.api.errors import ErrorResponse
from xema_ray.serving.messages import GenerateResult
from xema_ray.templates import RequestTemplate

_STATUS_TEXT = {403: "behind API keys: the key is not an admin key (auth.api_keys ... admin: true)",
                400: "a request this deployment cannot serve (the message says what it can)",
                404: "no such video or file: it never existed, was deleted or has expired",
                429: "this API key's tenant has auth.max_jobs_in_flight video jobs queued or running (with Retry-After)"}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def documented(*statuses: int, media: tuple[str, ...] = ()) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of an endpoint: its error statuses and, where the endpoint builds the
    answer itself, the media types of its 200."""
    out: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse, "description": _STATUS_TEXT[s]} for s in statuses}
    if 429 in out:
        out[429]["headers"] = _RETRY_AFTER
    if media:
        out[200] = {"description": "the file", "content": {m: {"schema": {"type": "string", "format": "binary"}}
                                                          for m in media}}
    return out


def where_headers(t: RequestTemplate, out: GenerateResult) -> dict[str, str]:
    """Response headers saying how the request ran: template, batch and the workers of its group."""
    headers = {"X-Xema-Template": t.shape_key, "X-Xema-Batch-Id": str(out.batch_id),
               "X-Xema-Batch-Size": str(out.batch_size), "X-Xema-Workers": ",".join(map(str, out.workers)),
               "X-Xema-Batch-Seconds": f"{out.batch_seconds:.4f}", "X-Xema-Quality": out.quality}
    if out.quality_note is not None:  # asked for a lossy tier, served lossless (too few steps to skip one)
        headers["X-Xema-Quality-Note"] = out.quality_note
    if out.emulated:  # an emulated worker made it: no model ran (docs/emulated.md)
        headers["X-Xema-Emulated"] = "true"
    if out.group_seconds is not None:  # queued + batch time in the model group; the rest is the front end
        headers["X-Xema-Group-Seconds"] = f"{out.group_seconds:.4f}"
    if out.queued_s is not None:  # how long it waited in its group's queue, and which replica ran it
        headers["X-Xema-Queue-Seconds"] = f"{out.queued_s:.4f}"
    if out.replica is not None:
        headers["X-Xema-Replica"] = out.replica
    if out.prompt_tokens is not None:
        # the model's own tokenizer counted the prompt; past the encoder's limit it was truncated (not an error)
        headers["X-Xema-Prompt-Tokens"] = str(out.prompt_tokens)
        headers["X-Xema-Prompt-Truncated"] = "true" if out.prompt_truncated else "false"
    return headers


def front_timing(entered: float, called: float, answered: float) -> dict[str, str]:
    """Response headers splitting the front door's time (perf_counter seconds): ``X-Xema-Call-Seconds``
    from the Router's call to the model group to its answer (the group's own time, Serve's routing
    and both hops), ``X-Xema-Router-Seconds`` from the Router's handler starting to its response
    (the call plus parsing, encoding, JSON). The proxy's ``X-Xema-Proxy-Seconds`` less the latter is
    the proxy and its hop to the Router."""
    return {"X-Xema-Call-Seconds": f"{answered - called:.4f}",
            "X-Xema-Router-Seconds": f"{time.perf_counter() - entered:.4f}"}
