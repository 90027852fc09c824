"""The ledger, seen live: ``/memory/pages`` (who owns every KV page, as runs) and ``/dashboard``
(a self-contained page drawing it). Both are admin paths (``auth.ADMIN_PATHS``)."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

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
    return HTMLResponse(page, headers={"Cache-Control": "no-store"})
