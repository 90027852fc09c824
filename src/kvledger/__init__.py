"""kvledger: an LLM-serving engine whose KV memory is a ledger."""

import os

# The kernels split their work over their own pool (kernels/csrc/pool.h); torch's OpenMP threads, which
# spin for a while after each of torch's own parallel regions, then hold the cores that pool's workers
# need (quiet decode 15-20% slower with the default active wait on 2 cores, bench/RESULTS.md issue 55).
# Passive: they sleep at once. libgomp reads this when torch loads it, so it is set before any import
# of torch here; a value the operator set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
