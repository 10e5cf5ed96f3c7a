"""``/ui``: the console's static files (``static/``: hand-written HTML, CSS and JS, SVG plots; no
build step, nothing fetched from another host), mounted on the Router's FastAPI app. ``/ui`` is the
playground, ``/ui/operator.html`` the operator view. The pages hold no data: what they show comes
from the API with the key the user entered (kept in the browser's localStorage), so the files are
served without a key, like the OpenAPI document."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"

#: the pages' Content-Security-Policy: every fetch, script, style and image from the app's own origin
#: (images and videos also from blob:/data: URLs the pages make of API answers)
CSP = ("default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; style-src 'self'; "
       "script-src 'self'; connect-src 'self'; frame-ancestors 'none'")


class ConsoleFiles(StaticFiles):
    """StaticFiles with the console's CSP and no caching of the pages across versions."""

    async def get_response(self, path, scope):  # type: ignore[no-untyped-def]
        response = await super().get_response(path, scope)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-cache"
        return response


def install_ui(app: FastAPI) -> None:
    """Mount ``/ui`` on ``app`` (``/ui`` redirects to ``/ui/``, where ``index.html`` is the playground)."""

    @app.get("/ui", include_in_schema=False)
    async def ui_root() -> RedirectResponse:
        return RedirectResponse("/ui/", status_code=307)

    app.mount("/ui/", ConsoleFiles(directory=STATIC, html=True), name="ui")
