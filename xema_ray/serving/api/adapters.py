"""The adapter admin API: ``POST /v1/adapters`` ``{name, model, path}`` (or ``experts``: a LoRA
pair), ``GET /v1/adapters``, ``DELETE /v1/adapters/{name}`` (an admin key when keys are set: ``auth.api_keys[].admin``).

The Router's three routes (``ADD_ROUTE``, ``LIST_ROUTE``, ``DELETE_ROUTE``: their documentation)
hand each call to its ``AdapterAdmin``, which holds the groups' handles. A file is loaded on every worker of the model's group or on none
(``xema_ray.serving.group.adapters``); a refusal is a 422 naming the adapter and the first
offending key, a name already loaded a 409, a non-admin key a 403, and a path outside the
group's ``adapters.roots`` (default its ``adapters.dir``; symlinks resolved) a 403 with one
message whether or not the file exists.
"""

# no `from __future__ import annotations`: FastAPI must see the request models as real classes

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from xema_ray.lora_pool import AdapterInfo, AdapterPathRefused, AdapterRejected, AdapterSource, PoolStats
from xema_ray.serving.api.auth import admin_of
from xema_ray.serving.api.errors import ErrorResponse, cause_of, error_response, exception_response
from xema_ray.serving.api.validation import parse_request, request_body_doc
from xema_ray.serving.group.adapters import AdapterConflict
from xema_ray.serving.group.handle import GroupHandle

#: longest wait for a group's pool counters (a group that answers later is left out of that answer)
STATS_TIMEOUT_S = 5.0


def _errors(**statuses: str) -> dict[int | str, dict[str, Any]]:
    return {int(k.removeprefix("s")): {"model": ErrorResponse, "description": v} for k, v in statuses.items()}


_ADMIN = "managing adapters needs an admin API key (auth.api_keys[].admin), keys being set"


class AdapterList(BaseModel):
    """``GET /v1/adapters``."""

    object: str = "list"
    data: list[AdapterInfo] = Field(description="every model's loaded adapters")
    pools: dict[str, list[PoolStats]] = Field(default_factory=dict, description="per model, each worker's pool: "
                                                                                "residency, copies, waits")


def _refused(e: BaseException) -> JSONResponse | None:
    cause = cause_of(e)
    cause = getattr(cause, "cause", None) or cause
    if isinstance(cause, AdapterPathRefused):
        return error_response(403, str(cause), "permission_error", param=cause.param, code="adapter_path_refused")
    if isinstance(cause, AdapterRejected) and cause.param is not None:  # a request field at fault (e.g. experts)
        return error_response(422, str(cause), param=cause.param, code="adapter_rejected")
    if isinstance(cause, AdapterConflict):
        return error_response(409, str(cause), param="name", code="adapter_exists")
    if isinstance(cause, AdapterRejected):
        return error_response(422, str(cause), param=f"adapter:{cause.adapter}" + (f" key:{cause.key}" if cause.key else ""),
                              code="adapter_rejected")
    return exception_response(e)


#: the routes' documentation (``Router.add_adapter``, ``list_adapters``, ``delete_adapter``)
ADD_ROUTE: dict[str, Any] = dict(
    response_model=None, status_code=201, openapi_extra=request_body_doc(AdapterSource),
    responses={201: {"model": AdapterInfo, "description": "loaded on every worker of the group"},
               **_errors(s403=_ADMIN + "; or path is outside adapters.roots (one answer whether or not the file "
                                       "exists)", s409="an adapter of that name is loaded (DELETE it first)",
                         s422="a field is bad, or the file cannot serve the model: names the "
                              "adapter and the first offending key")})
LIST_ROUTE: dict[str, Any] = dict(response_model=None,
                                  responses={200: {"model": AdapterList, "description": "the adapters"}})
DELETE_ROUTE: dict[str, Any] = dict(response_model=None,
                                    responses=_errors(s403=_ADMIN, s404="no model has that adapter loaded",
                                                      s422="model names no served model"))


def _forbidden(request: Request) -> JSONResponse | None:
    if admin_of(request):
        return None
    return error_response(403, "managing adapters needs an admin API key (auth.api_keys[].admin: true)",
                          "permission_error", code="admin_key_required")


class AdapterAdmin:
    """The admin endpoints' work over every model group (the Router holds one and its routes call it).

    Args:
        groups: model name -> its group's handle.
    """

    def __init__(self, groups: Mapping[str, GroupHandle]) -> None:
        self.groups = groups

    async def pool_stats(self, timeout_s: float,
                         skip: Callable[[str], bool] = lambda _m: False) -> dict[str, list[PoolStats]]:
        """Per model serving adapters, each worker's pool (``/v1/stats``; a group that does not
        answer within ``timeout_s``, or that ``skip`` names, e.g. one scaled to zero, is left out)."""
        async def ask(model: str) -> list[PoolStats]:
            try:
                return list(await asyncio.wait_for(self.groups[model].adapter_stats(), timeout=timeout_s))
            except Exception:  # noqa: BLE001 — stats never fail the answer
                return []

        models = [m for m in sorted(self.groups) if not skip(m)]
        answers = await asyncio.gather(*(ask(m) for m in models))
        return {m: a for m, a in zip(models, answers, strict=True) if a}

    async def add_adapter(self, request: Request) -> Any:
        """``POST /v1/adapters``: load an adapter file on every worker of its model's group."""
        if (denied := _forbidden(request)) is not None:
            return denied
        source = await parse_request(request, AdapterSource)
        if source.model not in self.groups:
            return error_response(422, f"model: {source.model!r} is not served; served: {', '.join(sorted(self.groups))}",
                                  param="model", code="invalid_value")
        try:
            info = await self.groups[source.model].add_adapter(source)
        except Exception as e:
            mapped = _refused(e)
            if mapped is None:
                raise
            return mapped
        return JSONResponse(status_code=201, content=info.model_dump(mode="json"))

    async def list_adapters(self, request: Request) -> Any:
        """``GET /v1/adapters``: every model's loaded adapters and its pools' residency (behind API
        keys, each adapter's server-side file path only for an admin key)."""
        models = sorted(self.groups)
        lists = await asyncio.gather(*(self.groups[m].list_adapters() for m in models), return_exceptions=True)
        pools = await self.pool_stats(STATS_TIMEOUT_S)
        # a group still starting (or being rebuilt) has no workers to ask: its adapters are listed once it serves
        data = [i for infos in lists if not isinstance(infos, BaseException) for i in infos]
        if not admin_of(request):  # a tenant sees what it may ask for, not where the server keeps it
            data = [i.model_copy(update={"path": "", "experts": {k: "" for k in i.experts}}) for i in data]
        body = AdapterList(data=data, pools=pools)
        return JSONResponse(content=body.model_dump(mode="json"))

    async def delete_adapter(self, name: str, request: Request, model: str | None = None) -> Any:
        """``DELETE /v1/adapters/{name}``: unload ``name`` (of ``model``, or of every model that has it)."""
        if (denied := _forbidden(request)) is not None:
            return denied
        if model is not None and model not in self.groups:
            return error_response(422, f"model: {model!r} is not served", param="model", code="invalid_value")
        models = [model] if model is not None else sorted(self.groups)
        removed = await asyncio.gather(*(self.groups[m].remove_adapter(name) for m in models))
        if not any(removed):
            return error_response(404, f"adapter {name!r} is not loaded", param="name", code="adapter_not_found")
        return JSONResponse(content={"id": name, "object": "adapter.deleted", "deleted": True,
                                     "models": [m for m, r in zip(models, removed, strict=True) if r]})
