"""The ledger, seen live: ``/memory/pages`` (who owns every KV page, as runs) and ``/dashboard``
(a self-contained page drawing it).

``/memory/pages`` is an admin path (``auth.ADMIN_PATHS``). ``/dashboard`` itself is open: a static
page with no data. It reads ``/memory/pages`` with the browser's cookie of ``POST /dashboard/login``
(an admin path: the admin key as a bearer token, typed into the page once and not kept by it), which
opens that one GET and nothing else (``auth.DashboardLogins``): no credential the browser would
resend by itself to a POST, so no other site can act through an operator's browser."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from ..state import state

router = APIRouter()


@router.get("/memory/pages")
async def memory_pages(request: Request):
    """``{"runs": [{start, count, kind, owner}], "memory": {...}, "requests", "sessions", "radix",
    "last_audit"}``, all taken in one engine call so that the runs add up to the figures."""
    return await state(request).live_client().call("page_map")


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard(request: Request):
    state(request).live_client()
    page = resources.files("kvledger.server.static").joinpath("dashboard.html").read_text()
    # No other site may frame it (clickjacking its login form) or load anything into it.
    headers = {
        "Cache-Control": "no-store",
        "X-Frame-Options": "DENY",
        "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "frame-ancestors 'none'",
    }
    return HTMLResponse(page, headers=headers)


@router.post("/dashboard/login")
async def dashboard_login(request: Request):
    """Admin only (the middleware checked the key): a cookie for the dashboard's reads."""
    logins = state(request).logins
    token = logins.issue()
    secure = request.url.scheme == "https"
    return JSONResponse({"success": True}, headers={"Set-Cookie": logins.set_cookie(token, secure)})
