"""Exceptions that cross module boundaries, each mapped to one HTTP status by the server."""

from __future__ import annotations


class KVLedgerError(Exception):
    """Base class of every error kvledger raises on purpose."""

    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape, ``{"error": {message, type, param, code}}``: every error body is built here."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ValidationError(KVLedgerError):
    """Bad input from a client (HTTP 400). Raised before anything is allocated."""

    status = 400
    type = "invalid_request_error"


class NotFoundError(KVLedgerError):
    status = 404
    type = "not_found_error"


class ConflictError(KVLedgerError):
    status = 409
    type = "conflict_error"


class OverloadedError(KVLedgerError):
    status = 429
    type = "overloaded_error"


class ModelLoadError(KVLedgerError):
    """A model that cannot be loaded: missing, corrupt, truncated or unsupported. One line, no traceback."""

    status = 500
    type = "model_load_error"


class MemoryLedgerError(KVLedgerError):
    """The ledger's books do not balance (raised in strict mode only)."""

    status = 500
    type = "memory_ledger_error"


class ServiceUnavailable(KVLedgerError):
    """The engine is not ready, restarting, shutting down or dead (HTTP 503)."""

    status = 503
    type = "service_unavailable"


_BY_STATUS: dict[int, type[KVLedgerError]] = {
    400: ValidationError,
    404: NotFoundError,
    409: ConflictError,
    429: OverloadedError,
    503: ServiceUnavailable,
}


def error_for_status(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> KVLedgerError:
    """Rebuild an error that crossed a process boundary as (status, message, code, param)."""
    cls = _BY_STATUS.get(status)
    if cls is not None:
        return cls(message, code=code, param=param)
    e = KVLedgerError(message, code=code, param=param)
    e.status = status
    return e
