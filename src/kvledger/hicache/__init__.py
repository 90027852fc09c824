"""The hierarchical KV cache (SGLang's HiCache): a host-memory tier (L2) and a file tier (L3) under
the radix cache, every page in the ledger's books.

Modules: ``host_pool.py`` (L2 pages, page-first, and the L1<->L2 copies), ``storage.py`` (L3 files,
chained page keys, salt), ``io.py`` (the file I/O thread), ``tree.py`` (the radix tree over the
tiers: matching past L1, demotion and eviction), ``tiers.py`` (the policy: backups, prefetches,
sessions), ``connector.py`` (load-back on the KV connector seam), ``books.py`` (the L2 books).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets

import torch

from .books import TierBooks
from .connector import HiCacheConnector
from .host_pool import HostPool
from .storage import FileStorage, PageHasher, load_or_create_salt
from .tiers import Tiers

log = logging.getLogger(__name__)

__all__ = ["HiCacheConnector", "TierBooks", "Tiers", "build_tiers"]


def model_fingerprint(path: str) -> str:
    """Which weights made the KV: sizes and the first MiB of each weight file (cheap, and enough to
    tell two checkpoints apart; the namespace adds dtype and layout)."""
    h = hashlib.sha256()
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".gguf"))
        )
    )
    for f in files:
        h.update(os.path.basename(f).encode() + str(os.path.getsize(f)).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:32]


def build_tiers(cfg, model_path: str, model_cfg, local_cfg, dtype, num_l1_pages: int, device: str) -> Tiers:
    """The L2 pool (``hicache_size`` GB, else ``hicache_ratio`` x L1) and, with a storage backend, L3."""
    ps = cfg.cache.page_size
    layers, heads, dim = local_cfg.num_layers, local_cfg.num_kv_heads, local_cfg.head_dim
    page_bytes = 2 * layers * heads * ps * dim * torch.empty((), dtype=dtype).element_size()
    if cfg.hicache.hicache_size > 0:
        num = int(cfg.hicache.hicache_size * 1e9 // page_bytes)
    else:
        num = int(num_l1_pages * cfg.hicache.hicache_ratio)
    num = max(num, 1)
    host = HostPool(num, ps, layers, heads, dim, dtype, pin_memory=device.startswith("cuda"))
    namespace = "|".join(
        (
            model_fingerprint(model_path),
            f"{dtype}".removeprefix("torch."),
            cfg.model.quantization or "dense",
            f"{layers}x{heads}x{dim}",
            f"page{ps}",
            f"tp{0}/{cfg.parallel.tp_size}",
            "page_first",
        )
    )
    storage = None
    if cfg.hicache.hicache_storage_backend == "file":
        storage = FileStorage(cfg.hicache.hicache_storage_dir, namespace, page_bytes)
    if cfg.hicache.hicache_salt:
        salt = cfg.hicache.hicache_salt.encode()
    elif storage is not None:
        salt = load_or_create_salt(cfg.hicache.hicache_storage_dir)
    else:
        salt = secrets.token_bytes(32)  # no persistence: keys need not outlive this process
    if storage is not None and ps < 16:
        log.warning(
            "hicache: page size %d makes one L3 file per %d token(s); 16 or more is kinder to disks", ps, ps
        )
    log.info(
        "hicache: L2 %d pages (%d tokens, %.0f MiB, %s)%s",
        num, num * ps, num * page_bytes / 2**20, cfg.hicache.hicache_write_policy,
        f", L3 files in {cfg.hicache.hicache_storage_dir} ({storage.files} pages there)" if storage else "",
    )  # fmt: skip
    return Tiers(
        host,
        cfg.hicache.hicache_write_policy,
        PageHasher(salt, namespace, ps),
        storage,
        load_back_threshold=cfg.hicache.hicache_load_back_threshold,
        prefetch_threshold=cfg.hicache.hicache_prefetch_threshold,
        prefetch_timeout_s=cfg.hicache.hicache_prefetch_timeout_s,
    )
