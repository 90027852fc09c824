"""The settings checked before anything starts: the values (each section's own ``check``, in
``config``), then what needs the world outside them, each asked of the layer that owns it: the L3
storage directory (``hicache/storage.py``: the disk), several nodes' key (``parallel/rendezvous.py``:
the environment), PD's key and transport (``disagg/start_check.py``: the disk, the environment, an
optional package), the draft model (``spec/setup.py``) and the LoRA adapters (``parts.py``) on disk,
the device (``engine/resources.py``: the hardware) and which features combine (``compat.py``).
``config`` itself imports none of them (docs/overview.md).

Called from every path that starts an engine, before anything is allocated: the CLI
(``kvledger serve`` / ``generate``: a bad flag is one line and exit 2, before the model is read) and
the composition root (``build_parts``: the offline ``Engine``, the engine process)."""

from __future__ import annotations

from ..compat import check_combinations
from ..config import EngineConfig
from ..disagg.start_check import check_pd_settings
from ..engine.resources import resolve_device
from ..hicache.storage import check_storage_dir
from ..parallel.rendezvous import check_group_key
from ..spec.setup import check_draft_model
from .parts import check_lora_paths


def check_settings(cfg: EngineConfig) -> str:
    """Every check that needs no model; returns the device the engine runs on. A refused setting is
    a ``ValidationError`` naming it (the CLI's one line and exit 2; a 400 nowhere: this is start)."""
    cfg.check()  # the values alone, section by section
    cfg.hisparse.check_budget(cfg.cache.page_size)  # a budget in tokens is whole pages
    h = cfg.hicache
    if h.enable_hierarchical_cache and h.hicache_storage_backend == "file":
        check_storage_dir(h.hicache_storage_dir, salt_kept=not h.hicache_salt)  # the one that touches the disk
    check_group_key(cfg)  # several nodes' shared key: a file, or the environment's
    check_pd_settings(cfg.disagg)
    check_draft_model(cfg.spec)
    check_lora_paths(cfg)
    device = resolve_device(cfg.model.device)
    check_combinations(cfg, device)
    return device
