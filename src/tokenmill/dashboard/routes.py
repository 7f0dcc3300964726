"""The dashboard's routes: the page and its two files (package data, no CDN: it works offline), the
chart data as JSON, and one request's timeline. Mounted by `tokenmill serve` (api_server.py); any
other FastAPI app with a `MetricsHistory` can mount it the same way."""

from __future__ import annotations

import html
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenmill.dashboard.history import MetricsHistory
from tokenmill.dashboard.recent_requests import SORT_KEYS, RecentRequests

STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
DEFAULT_SLOWEST = 20


def _static(name: str) -> str:
    return resources.files("tokenmill.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def _not_found(message: str, param: str) -> JSONResponse:
    # OpenAI's error body, as every other error of the server.
    body = {"error": {"message": message, "type": "not_found_error", "param": param, "code": 404}}
    return JSONResponse(body, status_code=404)


def _bad_request(message: str, param: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}}
    return JSONResponse(body, status_code=400)


def dashboard_router(history: MetricsHistory, recent: RecentRequests | None = None, *, title: str = "tokenmill") -> APIRouter:
    router = APIRouter(include_in_schema=False)
    page = _static("index.html").replace("{{title}}", html.escape(title))

    @router.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/static/{name}")
    async def dashboard_static(name: str) -> Response:
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            return _not_found(f"no dashboard file {name!r}; there are {sorted(STATIC_FILES)}", "name")
        return Response(_static(name), media_type=media_type, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/data")
    async def dashboard_data(since: float | None = None, slowest: int = DEFAULT_SLOWEST, sort: str = "e2e") -> Any:
        """Chart points after Unix time `since` (all kept points without it), the totals, and the
        `slowest` recent requests by `sort` (e2e, ttft or queue)."""
        if sort not in SORT_KEYS:
            return _bad_request(f"sort must be one of {', '.join(SORT_KEYS)}; got {sort!r}", "sort")
        if not 0 <= slowest <= 1000:
            return _bad_request(f"slowest must be between 0 and 1000; got {slowest}", "slowest")
        history.maybe_sample()
        return {
            "title": title,
            "interval_s": history.interval_s,
            "window_s": history.window_s,
            "cost_per_hour": history.cost_per_hour,
            "points": history.points_since(since),
            "totals": history.totals(),
            "slowest": recent.slowest(slowest, sort) if recent is not None else [],
        }

    @router.get("/dashboard/requests/{request_id}")
    async def dashboard_request(request_id: str) -> Any:
        found = recent.get(request_id) if recent is not None else None
        if found is None:
            return _not_found(
                f"no recent finished request {request_id!r}; the dashboard keeps the last "
                f"{len(recent) if recent is not None else 0} (see /dashboard/data's slowest)",
                "request_id",
            )
        return found.detail()

    return router
