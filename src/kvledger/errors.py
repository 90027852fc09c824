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
        """The OpenAI error shape: {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
