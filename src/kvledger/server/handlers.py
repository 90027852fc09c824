"""Errors of the front in the OpenAI shape (every status, never FastAPI's 422), and body parsing."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import KVLedgerError, ValidationError, error_body
from .fields import check_fields

log = logging.getLogger("kvledger.server")


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code=None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


async def parse_body(request: Request, model: type[BaseModel]):
    """Parse the JSON body into ``model`` (``middleware.CSRFMiddleware`` let only an
    ``application/json`` POST through)."""
    raw = await request.body()
    try:
        # UTF-8 only (RFC 8259 8.1): json.loads would also guess UTF-16 or UTF-32 from bytes.
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        # ValueError: not JSON, not UTF-8, or an integer too long to convert; RecursionError:
        # nesting deeper than the parser goes. All the client's body, none a fault of ours.
        raise ValidationError(f"malformed JSON body: {str(e)[:200]}", code="invalid_json") from None
    try:
        body = model.model_validate(data)
    except PydanticValidationError as e:
        raise RequestValidationError(e.errors()) from None
    check_fields(body)  # peer fields not implemented: 400; unknown ones: a warning
    return body


def install(app: FastAPI) -> None:
    @app.exception_handler(KVLedgerError)
    async def kv_error(_: Request, e: KVLedgerError):
        # Overloaded or not ready: a client may come back (in a second: the engine steps in ms).
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', '')}"
            return error_response(400, msg, "invalid_request_error", code="invalid_json")
        loc = [str(x) for x in first.get("loc", []) if x not in ("body", "function-after")]
        param = ".".join(loc) or None
        msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(400, msg, "invalid_request_error", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), type_)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}", "internal_error")
