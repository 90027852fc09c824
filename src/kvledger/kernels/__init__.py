"""kvledger's CPU kernels: a C++ extension (``csrc/``) registered as torch ops ``kvledger_cpu::*``.

Built with ``torch.utils.cpp_extension`` on first use (about a minute on 2 cores, once: the build is
cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and loaded from there
afterwards. Without a compiler, or with ``KVLEDGER_CPU_KERNELS=0``, ``load()`` returns False with one
log line and the model runs its pure-torch path. The AVX-512 kernels are chosen at run time from the
CPU's flags (``KVLEDGER_CPU_ISA=scalar`` forces the portable ones); ``isa()`` says which.

Every op has a fake implementation, so ``torch.compile`` treats them as opaque calls.

The kernels split their work over their own thread pool (``csrc/pool.h``: chunks claimed dynamically,
bounded spin then sleep, a governor that works with fewer threads while another process holds a
core), not torch's OpenMP one. ``set_threads`` sizes both; by default they take the cores this
process may run on (``os.sched_getaffinity``), not the machine's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from pathlib import Path

import torch

from ..common.cpus import default_threads

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("ops.cpp", "scalar.cpp", "avx512.cpp", "flash_bf16.cpp", "flash_amx.cpp", "qlinear_scalar.cpp", "qlinear_vnni.cpp", "qlinear_amx.cpp", "gguf_scalar.cpp", "gguf_vnni.cpp", "gguf_repack.cpp", "gguf_packed_vnni.cpp", "dense.cpp", "pool.cpp", "decode_step.cpp", "hisparse.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "reason": "not tried", "threads": None}


def set_threads(n: int | None = None) -> int:
    """Size this process's compute threads: torch's intra-op pool and the kernels' pool alike, so
    neither oversubscribes the other's cores. None: ``default_threads()``. Applied to the kernels'
    pool now if they are loaded, else when ``load()`` loads them. Returns the count."""
    n = n or default_threads()
    with _lock:
        _state["threads"] = n
        ok = bool(_state["ok"])
    torch.set_num_threads(n)
    if ok:
        torch.ops.kvledger_cpu.set_threads(n)
    return n


def pool_stats() -> dict[str, int]:
    """The kernels' pool: ``threads`` configured, ``active`` (what the governor allows now), ``jobs``
    run, governor ``drops`` and ``restores``, ``long_wait_ns`` (time callers waited on a descheduled
    thread), ``governed``. Empty without the kernels."""
    if not _state["ok"]:
        return {}
    keys = ("threads", "active", "jobs", "drops", "restores", "long_wait_ns", "governed")
    return dict(zip(keys, torch.ops.kvledger_cpu.pool_stats()))


def set_governor(on: bool) -> None:
    """Turn the pool's governor on (the default) or off (every job on every configured thread)."""
    if load():
        torch.ops.kvledger_cpu.set_governor(on)


def _build() -> None:
    """torch's build-and-load of the extension (``torch.utils.cpp_extension.load``)."""
    from torch.utils.cpp_extension import load as build

    build(
        name="kvledger_cpu_ops",
        sources=[str(_CSRC / s) for s in _SOURCES],
        # fp-contract off: the kernels round where torch's eager ops round (no fused a*b+c
        # that the reference does not do), so fp32 results differ only in reduction order.
        extra_cflags=["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"],
        extra_ldflags=["-fopenmp"],  # at::parallel_for is OpenMP in a header: serial without it
        is_python_module=False,
        verbose=False,
    )


@contextlib.contextmanager
def _build_guard(name: str):
    """Hold an OS file lock on the extension's build directory while torch builds or loads it, and
    clear torch's own ``lock`` file if one is left there. torch serializes builds with a file it
    creates and deletes (``FileBaton``): a process killed while it held it (a first start stopped with
    Ctrl-C during the minute-long build) leaves the file behind, and every later start waits on it
    forever, silently. Every kvledger process that builds or loads holds this flock first, and the
    OS drops a flock with its process, so a ``lock`` file found while holding it is such a leftover."""
    from torch.utils.cpp_extension import _get_build_directory

    d = Path(_get_build_directory(name, verbose=False))
    with open(d / "kvledger.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = d / "lock"
            if stale.exists():
                log.warning("CPU kernels: removing %s, left by a build or load that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load() -> bool:
    """Build (first time) and load the extension; True when ``torch.ops.kvledger_cpu`` is usable."""
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        _state["tried"] = True
        if os.environ.get("KVLEDGER_CPU_KERNELS", "1") == "0":
            _state["reason"] = "disabled by KVLEDGER_CPU_KERNELS=0"
            log.info("CPU kernels: %s; using the torch fallback", _state["reason"])
            return False
        t0 = time.monotonic()
        try:
            with _build_guard("kvledger_cpu_ops"):
                _build()
        except Exception as e:  # no compiler, no ninja, a failed build: serve on without the kernels
            _state["reason"] = (
                f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            )
            log.warning("CPU kernels unavailable (%s); using the torch fallback", _state["reason"])
            return False
        _register_fakes()
        torch.ops.kvledger_cpu.set_threads(int(_state["threads"] or default_threads()))
        if os.environ.get("KVLEDGER_THREAD_GOVERNOR", "1") == "0":
            torch.ops.kvledger_cpu.set_governor(False)
        _state["ok"] = True
        _state["reason"] = "loaded"
        log.info(
            "CPU kernels: loaded in %.1fs (isa %s, quantized linear %s)",
            time.monotonic() - t0,
            isa(),
            quant_isa(),
        )
        return True


def status() -> str:
    """Why the kernels are (not) in use, for logs and /get_server_info."""
    return str(_state["reason"])


def isa() -> str:
    """``avx512`` or ``scalar``: the kernels this CPU runs."""
    return str(torch.ops.kvledger_cpu.isa()) if _state["ok"] else "none"


def has_bf16_dot() -> bool:
    """Whether ``flash_attention_`` runs here (a CPU with AVX512-BF16, the kernels loaded)."""
    return bool(_state["ok"]) and bool(torch.ops.kvledger_cpu.has_bf16_dot())


def has_amx() -> bool:
    """The quantized linear may run on AMX tiles here: the CPU has AMX-BF16 and Linux granted this
    process the tile state (``csrc/qlinear_amx.cpp``)."""
    return bool(_state["ok"]) and bool(torch.ops.kvledger_cpu.has_amx())


def quant_isa() -> str:
    """``avx512-vnni`` or ``scalar``: the quantized linear kernels this CPU runs."""
    return str(torch.ops.kvledger_cpu.quant_isa()) if _state["ok"] else "none"


def _register_fakes() -> None:
    lib = "kvledger_cpu::"

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, w, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "add_rms_norm")
    def _(residual, x, w, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake(lib + "silu_mul")
    def _(gu):
        return gu.new_empty(gu.shape[0], gu.shape[1] // 2)

    @torch.library.register_fake(lib + "rope_")
    def _(x, positions, cos, sin):
        return None

    @torch.library.register_fake(lib + "decode_attention")
    def _(q, k_cache, v_cache, req_to_token, rows, lens, scale, k_new=None, v_new=None, out_loc=None, head_stride=0,
          window=0):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake(lib + "hisparse_select")
    def _(q, k_new, v_new, host_k, host_v, summary, layer, host_table, lens, sink, recent, top_k):
        return q.new_empty(q.shape[0], 0, dtype=torch.int64), q.new_empty(q.shape[0], dtype=torch.int64)

    @torch.library.register_fake(lib + "hisparse_attention")
    def _(q, k_new, v_new, host_k, host_v, summary, layer, host_table, lens, sink, recent, top_k, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake(lib + "decode_layers")
    def _(h, w, scales, wsum, bits, n, dense, norms, desc, k_all, v_all, *rest):
        return None

    @torch.library.register_fake(lib + "head_argmax")
    def _(x, w, scales, wsum128, bits, n, valid):
        return x.new_empty(x.shape[0], dtype=torch.int64)

    @torch.library.register_fake(lib + "extend_attention_")
    def _(out, q, k_cache, v_cache, req_to_token, rows, starts, prefix, lens, scale, window=0):
        return None

    @torch.library.register_fake(lib + "kind_norm")
    def _(x, w, kind, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "add_kind_norm")
    def _(h, delta, w, kind, eps):
        return torch.empty_like(h)

    @torch.library.register_fake(lib + "kind_head_norm_")
    def _(qkv, col, heads, hd, w, kind, eps):
        return None

    @torch.library.register_fake(lib + "store_kv_")
    def _(k_cache, v_cache, k, v, out_loc):
        return None

    @torch.library.register_fake(lib + "gated_act")
    def _(gu, act):
        return gu.new_empty(gu.shape[0], gu.shape[1] // 2)

    @torch.library.register_fake(lib + "flash_attention_")
    def _(out, q, k_cache, v_cache, req_to_token, rows, starts, prefix, lens, scale, amx=True):
        return None

    @torch.library.register_fake(lib + "quantize_rows")
    def _(x):
        return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[0], dtype=torch.float32)

    @torch.library.register_fake(lib + "scale_rows")
    def _(y, scale, bias, like):
        return y.new_empty(y.shape, dtype=like.dtype)

    @torch.library.register_fake(lib + "int8_linear")
    def _(x, w, w_scale, woff, bias=None):
        return x.new_empty(x.shape[0], w_scale.shape[0])

    @torch.library.register_fake(lib + "dense_linear")
    def _(x, w, bias=None):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake(lib + "to_f8")
    def _(x):
        return x.new_empty(x.shape, dtype=torch.float8_e4m3fn)

    @torch.library.register_fake(lib + "from_f8")
    def _(x, dtype):
        return x.new_empty(x.shape, dtype=dtype)

    @torch.library.register_fake(lib + "gguf_linear")
    def _(x, w, kind, n, k, segments=None):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "quant_linear")
    def _(x, w, scales, wsum128, bits, n, amx_rows=0):
        return x.new_empty(x.shape[0], n)
