"""The hierarchical KV cache (SGLang's HiCache): a host-memory tier (L2) and a file tier (L3) under
the radix cache, every page in the ledger's books.

Modules: ``host_pool.py`` (L2 page ids, and each rank's L2 data with the L1<->L2 copies),
``storage.py`` (L3 files, chained page keys, salt), ``io.py`` (a rank's file I/O thread),
``tree.py`` (the radix tree over the tiers: matching past L1, demotion and eviction), ``tiers.py``
(the policy, rank 0: backups, sessions), ``prefetch.py`` (L3 prefetches for queued requests),
``ops.py`` (what the policy tells every rank to move), ``mover.py`` (one rank's data movement),
``connector.py`` (load-back on the KV connector seam; its worker side runs on every rank),
``books.py`` (the L2 books).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets

from .books import TierBooks
from .connector import Gather, HiCacheConnector, HiCacheWorker
from .host_pool import HostKV, HostPool
from .mover import TierMover
from .storage import FileStorage, PageHasher, load_or_create_salt
from .tiers import Tiers

log = logging.getLogger(__name__)

__all__ = ["HiCacheConnector", "HiCacheWorker", "TierBooks", "Tiers", "build_tiers", "build_worker_side"]


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


def namespace(model_path: str, dtype, quantization: str | None, local_cfg, page_size: int, rank: int,
              tp_size: int) -> str:  # fmt: skip
    """What an L3 key is made under: which weights, dtype and quantization made the KV, its layout
    (this rank's KV heads), page size, and the tp rank and size (each rank's files hold its heads)."""
    return "|".join(
        (
            model_fingerprint(model_path),
            f"{dtype}".removeprefix("torch."),
            quantization or "dense",
            f"{local_cfg.num_layers}x{local_cfg.num_kv_heads}x{local_cfg.head_dim}",
            f"page{page_size}",
            f"tp{rank}/{tp_size}",
            "page_first",
        )
    )


def l2_num_pages(cfg, page_bytes: int, num_l1_pages: int) -> int:
    """L2 pages: ``hicache_size`` GB (of this rank's heads), else ``hicache_ratio`` x L1. Every rank
    computes the same number (same settings, same per-rank page size)."""
    if cfg.hicache.hicache_size > 0:
        return max(int(cfg.hicache.hicache_size * 1e9 // page_bytes), 1)
    return max(int(num_l1_pages * cfg.hicache.hicache_ratio), 1)


def build_mover(
    cfg, model_path: str, quantization: str | None, local_cfg, dtype, num_l1_pages: int, device: str, rank: int
) -> TierMover:
    """One rank's data side: its heads of the L2 pages and, with a storage backend, its L3 files."""
    ps = cfg.cache.page_size
    layers, heads, dim = local_cfg.num_layers, local_cfg.num_kv_heads, local_cfg.head_dim
    page_bytes = HostKV.page_bytes_of(ps, layers, heads, dim, dtype)
    num = l2_num_pages(cfg, page_bytes, num_l1_pages)
    host = HostKV(num, ps, layers, heads, dim, dtype, pin_memory=device.startswith("cuda"))
    ns = namespace(model_path, dtype, quantization, local_cfg, ps, rank, cfg.parallel.tp_size)
    storage = None
    if cfg.hicache.hicache_storage_backend == "file":
        storage = FileStorage(cfg.hicache.hicache_storage_dir, ns, page_bytes)
    if cfg.hicache.hicache_salt:
        salt = cfg.hicache.hicache_salt.encode()
    elif storage is not None:
        salt = load_or_create_salt(cfg.hicache.hicache_storage_dir)
    else:
        salt = secrets.token_bytes(32)  # no persistence: keys need not outlive this process
    return TierMover(host, PageHasher(salt, ns, ps), storage)


def build_tiers(cfg, model_path: str, local_cfg, dtype, num_l1_pages: int, device: str) -> Tiers:
    """Rank 0: the policy over the L2 page ids, and rank 0's data side (``cfg``: quantization
    resolved)."""
    mover = build_mover(cfg, model_path, cfg.model.quantization, local_cfg, dtype, num_l1_pages, device, 0)
    host = HostPool(mover.host.num_pages, cfg.cache.page_size)
    storage, ps, num = mover.storage, cfg.cache.page_size, host.num_pages
    if storage is not None and ps < 16:
        log.warning(
            "hicache: page size %d makes one L3 file per %d token(s); 16 or more is kinder to disks", ps, ps
        )
    log.info(
        "hicache: L2 %d pages (%d tokens, %.0f MiB%s, %s)%s",
        num, num * ps, num * mover.host.page_bytes / 2**20,
        f" per rank x {cfg.parallel.tp_size}" if cfg.parallel.tp_size > 1 else "",
        cfg.hicache.hicache_write_policy,
        f", L3 files in {cfg.hicache.hicache_storage_dir} ({storage.files} pages there)" if storage else "",
    )  # fmt: skip
    return Tiers(
        host,
        mover,
        cfg.hicache.hicache_write_policy,
        tp_size=cfg.parallel.tp_size,
        load_back_threshold=cfg.hicache.hicache_load_back_threshold,
        prefetch_threshold=cfg.hicache.hicache_prefetch_threshold,
        prefetch_timeout_s=cfg.hicache.hicache_prefetch_timeout_s,
    )


def build_worker_side(
    cfg, model_path: str, quantization: str | None, local_cfg, dtype, kv, rank: int, gather: Gather
) -> HiCacheWorker:
    """A tensor-parallel rank other than 0: its data side, bound to its L1 (``kv``)."""
    mover = build_mover(cfg, model_path, quantization, local_cfg, dtype, kv.k.shape[2] // cfg.cache.page_size,
                        "cpu" if kv.k.device.type == "cpu" else str(kv.k.device), rank)  # fmt: skip
    mover.bind(kv)
    return HiCacheWorker(mover, rank, gather)
