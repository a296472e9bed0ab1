"""The replay viewer: a static single-page app (``static/``) over the native API's SSE feeds.

``/`` serves its page and ``/static/`` its scripts and styles; everything it shows it reads
from the native routes, like any other client.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


async def index(_: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html")


def routes() -> list[BaseRoute]:
    """The viewer's page and its static files."""
    return [Route("/", index), Mount("/static", StaticFiles(directory=STATIC), name="static")]
