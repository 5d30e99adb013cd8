"""The web console at ``/``: one static page (HTML, CSS, JavaScript shipped in the package, no build step, nothing
from a CDN) with a chat playground and the live view; it reads only what ``/v1/*`` answers, with the API key the
user gives it. ``--disable-console`` leaves these routes out."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from engine.entrypoints.openai.errors import APIError

router = APIRouter()

CONSOLE_FILES = {"console.js": "text/javascript", "console.css": "text/css"}


def _read(name: str) -> bytes:
    return resources.files("engine.entrypoints.openai").joinpath("console", name).read_bytes()


@router.get("/", include_in_schema=False)
async def console_page():
    return HTMLResponse(_read("index.html"), headers={"Cache-Control": "no-cache"})


@router.get("/console/{name}", include_in_schema=False)
async def console_asset(name: str):
    if name not in CONSOLE_FILES:
        raise APIError(f"the console has no file {name!r}", 404)
    return Response(_read(name), media_type=CONSOLE_FILES[name], headers={"Cache-Control": "no-cache"})
