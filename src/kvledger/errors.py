"""Exceptions that cross module boundaries, each mapped to one HTTP status by the server."""

from __future__ import annotations


class KVLedgerError(Exception):
    """Base class of every error kvledger raises on purpose."""

    status: int = 500
    type: str = "internal_error"

    def __init_subclass__(cls, status: int | None = None, type_: str | None = None, **kw):
        super().__init_subclass__(**kw)  # a subclass without them keeps its parent's
        cls.status = cls.status if status is None else status
        cls.type = cls.type if type_ is None else type_

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


# Each error class: (HTTP status, OpenAI error type) and when it is raised.
class ValidationError(KVLedgerError, status=400, type_="invalid_request_error"):
    """Bad input from a client. Raised before anything is allocated."""


class NotFoundError(KVLedgerError, status=404, type_="not_found_error"):
    """An unknown model, request id, session or path."""


class PermissionDenied(KVLedgerError, status=403, type_="permission_error"):
    """A valid key that may not do this (an admin operation, another caller's request)."""


class ConflictError(KVLedgerError, status=409, type_="conflict_error"):
    """A duplicate in-flight request id, a busy session, a flush while requests run."""


class OverloadedError(KVLedgerError, status=429, type_="overloaded_error"):
    """The waiting queue or the session table is full."""


class ModelLoadError(KVLedgerError, status=500, type_="model_load_error"):
    """A model that cannot be loaded: missing, corrupt, truncated or unsupported. One line, no traceback."""


class MemoryLedgerError(KVLedgerError, status=500, type_="memory_ledger_error"):
    """The ledger's books do not balance (raised in strict mode only), or an operation would unbalance
    them (``OwnershipError``, every mode)."""


class OwnershipError(MemoryLedgerError):
    """A memory operation that would give a page or slot two owners or none (admitting a request that
    holds a slot, truncating into borrowed pages, freeing the pages a running turn reads, giving back an
    id outside its pool): refused before anything changes, in every mode. A real check, where an
    ``assert`` would vanish under ``python -O``."""


class ReleaseError(MemoryLedgerError):
    """Strict mode: a component failed while memory was being released (a release hook, a radix tree
    hook, a step of ``KVManager.release``). The release went on and completed; the failure was logged
    and counted (``memory.leak_check.contained_errors``) and is raised at the step's books check."""


class TransferError(KVLedgerError, status=502, type_="kv_transfer_error"):
    """PD disaggregation: the KV of a request did not arrive (the prefill side failed, refused, was
    refused or timed out). The request ends through the release path; nothing it held stays."""


class ServiceUnavailable(KVLedgerError, status=503, type_="service_unavailable"):
    """The engine is not ready, restarting, shutting down or dead."""


_BY_STATUS = {
    c.status: c
    for c in (
        ValidationError,
        NotFoundError,
        ConflictError,
        OverloadedError,
        TransferError,
        ServiceUnavailable,
    )
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
