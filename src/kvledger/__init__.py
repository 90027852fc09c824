"""kvledger: an LLM-serving engine whose KV memory is a ledger."""

from .config import EngineConfig, ServerConfig
from .engine import EngineCore
from .errors import KVLedgerError, ModelLoadError, ValidationError
from .launch import Engine
from .version import __version__

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineCore",
    "KVLedgerError",
    "ModelLoadError",
    "ServerConfig",
    "ValidationError",
    "__version__",
]
