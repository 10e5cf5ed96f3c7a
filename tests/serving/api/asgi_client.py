"""Call an ASGI app in-process (no server, no httpx): enough for the error-path tests."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AsgiResponse:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def json(self) -> Any:
        # strict: an error body must be JSON without NaN / Infinity
        return json.loads(self.body, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


async def call(app: Any, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
               chunks: int = 1, content_length: bool = True) -> AsgiResponse:
    hdrs = {"content-type": "application/json", **(headers or {})}
    if content_length:
        hdrs["content-length"] = str(len(body))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234),
             "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()]}
    step = max(1, -(-len(body) // chunks))
    parts = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    out: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
            out["raw"] = list(msg.get("headers", []))
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    await app(scope, receive, send)
    raw = out.get("raw", [])
    return AsgiResponse(out["status"], {k.decode().lower(): v.decode() for k, v in raw}, out["body"], raw)


def post_json(app: Any, path: str, payload: Any, **kw: Any) -> AsgiResponse:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return asyncio.run(call(app, "POST", path, body, **kw))
