"""kvledger: an LLM-serving engine whose KV memory is a ledger."""

import os

# The kernels split their work over their own pool (kernels/csrc/pool.h); torch's OpenMP threads, which
# spin for a while after each of torch's own parallel regions, then hold the cores that pool's workers
# need (quiet decode 15-20% slower with the default active wait on 2 cores, bench/RESULTS.md issue 55).
# Passive: they sleep at once. libgomp reads this when torch loads it, so it is set before any import
# of torch here; a value the operator set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .version import __version__

# The package's names load their modules on first use (PEP 562): ``kvledger serve``'s HTTP front
# imports ``kvledger.server`` and needs neither torch nor the engine (``import kvledger`` alone cost
# ~1.9 s of torch and the engine's modules, on the front's path to spawning the engine process).
_EXPORTS = {
    "Engine": ".launch",
    "EngineConfig": ".config",
    "EngineCore": ".engine",
    "KVLedgerError": ".errors",
    "ModelLoadError": ".errors",
    "ServerConfig": ".config",
    "ValidationError": ".errors",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
