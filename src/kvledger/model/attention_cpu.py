"""The ``cpu`` attention backend: decodes and extends (prefill chunks) in kvledger's C++ kernels
(``kernels/``).

The kernels read each request's K/V where it lies in the pool (through ``req_to_token``; no gather
copy), pack the query heads of one KV head so they share every K/V read, and sum each query's keys in
one order (chunks of 64 from position 0, each chunk's softmax alone, folded in order: csrc/flash.h):
a row gets the same bits from the decode, per-token and flash kernels, whatever its batch or chunk.
Decode splits long contexts over threads at those chunks; in a forward of decodes only it also writes
the new tokens' K/V into their pages (one call per layer instead of two index writes and a gather).

Extends: in bf16 on a CPU with AVX512-BF16 (head_dim a multiple of 64), extends of at least
``FLASH_MIN_NEW`` tokens run ``flash_attention_`` (K/V packed once per extend and KV head, tiles of 4
query rows share each load, products in ``vdpbf16ps``); shorter ones run ``extend_attention_``, where
each query token is a work item over its causal range (no packing: cheaper for a few tokens after a
long prefix). Measured here (SmolLM2 shapes, 2 threads): one 1,024-token prompt 4.9 ms a layer vs
SDPA 12.5; 512 tokens after 512 cached 3.8 vs 10.1; 8 prompts of 128 1.2 vs 3.4 (per-token kernel
2.3); 8 verifies of 5 after 300 0.37 per-token vs 0.53 flash. Without the bf16 kernel (no
AVX512-BF16, or float32), every extend sums in the per-token kernel's float form, however long: SDPA
sums a row otherwise than the decode kernel, so a prompt's rows would take other bits cold (one long
extend) than as a prefix-cache hit's tail or in chunks (issue 56). Calls of 16+ new tokens run that
form in tiles of query tokens inside ``extend_attention_`` (K/V widened to float once per extend and
KV head, each K row shared by ~16 query rows; the same bits per row: csrc/avx512.cpp ``extend_tile``):
Gemma 3 270M's 1,024-token prompt spends 377 instead of 642 ms in attention. ``--cpu-amx on``
(``sdpa_extends``) still sends long extends to SDPA.

On a CPU with AMX the flash kernel runs on the tiles (``flash_amx.cpp``: 16 query rows a call,
S^T = K Q^T and O^T += V^T P^T on the tile unit, the online softmax one row per vector lane), and
beats torch's SDPA, which also runs its bf16 products on AMX: SmolLM2 shapes, both threads, one
1,024-token prompt 1.75 ms a layer vs SDPA 2.91 (the vdpbf16ps kernel 8.2), 2,048 tokens 6.9 vs 9.7,
16 prompts of 128 1.35 vs 1.41. With ``sdpa_extends`` (``--cpu-amx``) and no AMX tiles, or over a
float8 pool on AMX (the AMX form packs the model's dtype), extends of at least ``FLASH_MIN_NEW`` tokens
go to SDPA (on AMX it was 2-2.5x the vdpbf16ps kernel: 5.9 vs 15.2 ms a layer for 1,024 tokens on one
thread). Elsewhere the vdpbf16ps form serves a float8 pool too, widening its values to bf16 as it
packs them (on an AMD Zen 4: a 1,024-token prompt over HTTP 0.74 s through SDPA, see bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import ATTENTION_BACKENDS
from ..errors import ModelLoadError
from .attention import AttentionBackend, TorchAttention
from .attention_batch import request_spans, sparse_meta, split_batch
from .attention_extend import attend_extends
from .batch import ForwardBatch


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, deterministic: bool = False) -> str:
    """``auto``: ``cpu`` (the C++ kernels) for bfloat16 on a CPU where they load, else ``torch``.
    float32 stays on ``torch`` unless asked: it is the token-exact reference path (the kernels sum in
    another order). ``cpu`` asked where it cannot run is an error, not a silent fallback; so is
    ``auto`` under ``deterministic`` inference, which needs the kernels (float32 too)."""
    if name not in ATTENTION_BACKENDS:
        raise ModelLoadError(
            f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}"
        )
    if name == "torch":
        return name
    usable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if name == "cpu" or deterministic:
        if not usable:
            raise ModelLoadError(
                f"the cpu attention backend runs on CPUs in float32/bfloat16, not {device.type} {dtype}"
            )
        if not kernels.load():
            raise ModelLoadError(
                f"the cpu attention backend needs kvledger's C++ kernels: {kernels.status()}"
            )
        return "cpu"
    return "cpu" if usable and dtype == torch.bfloat16 and kernels.load() else "torch"


FLASH_MIN_NEW = 64
"""With it: extends of at least this many new tokens run in the flash kernel (crossover measured
between 32 and 128 new tokens, lower with a short prefix)."""


def flash_usable(dtype: torch.dtype, head_dim: int) -> bool:
    """The bf16 prefill kernel runs for this model on this CPU."""
    return dtype == torch.bfloat16 and head_dim % 64 == 0 and kernels.has_bf16_dot()


@dataclass
class _CpuMeta:
    dec_tok: torch.Tensor | None  # [Bd] flat token index of each decode
    dec_rows: torch.Tensor | None  # [Bd] request-slot rows
    dec_lens: torch.Tensor | None  # [Bd] sequence lengths (the new token included)
    ext: tuple[torch.Tensor, ...] | None  # int64 [E] each: slot rows, first token, prefix, new tokens
    flash: tuple[torch.Tensor, ...] | None  # the same columns, extends for the bf16 flash kernel
    long_ext: list  # long extends, for SDPA: BatchSplit.sdpa_ext
    only_decodes: bool
    sparse: tuple | None = None  # HiSparse decodes (attention_batch.sparse_meta; + host pages, lengths)
    # Decodes only with HiSparse rows among them: (rows, lengths, sparse args) of the one-call decode
    one_call_sparse: tuple | None = None
    special: list[bool] | None = None  # the layers that take TorchAttention.attend_spans
    spans: list | None = None


class CpuAttention(TorchAttention):
    """Needs the kernels loaded (``kernels.load()``) and q, K/V of one dtype (float32 or bfloat16)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
        windows: list[int | None] | None = None,
        softcap: float | None = None,
        sdpa_extends: bool = False,
        sinks: list[torch.Tensor | None] | None = None,
        deterministic: bool = False,
    ):
        """``deterministic``: every extend in the kernels (no SDPA; the flash kernel's vdpbf16ps form, not
        its AMX form), whose rows all sum in one order (csrc/flash.h); windowed, soft-capped and sink
        layers one query row at a time (``TorchAttention.attend_spans``)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale, windows, softcap, sinks)
        self.op = torch.ops.kvledger_cpu.decode_attention
        self.extend_op = torch.ops.kvledger_cpu.extend_attention_
        self.flash_op = torch.ops.kvledger_cpu.flash_attention_
        self.flash = flash_usable(dtype, head_dim)
        # The flash kernel runs on AMX tiles where the CPU has them (csrc/flash_amx.cpp): then it beats
        # SDPA too, and long extends of a bf16 pool stay in the kernels even with sdpa_extends.
        self.deterministic = deterministic
        self.flash_amx = self.flash and kernels.has_amx() and not deterministic
        self.sdpa_extends = sdpa_extends and not deterministic
        self.row_wise = deterministic
        self.dtype = dtype

    @property
    def _flash_ok(self) -> bool:
        """The bf16 flash kernel packs K/V of the model's dtype, or off AMX of a float8 pool widened to
        bf16 as it packs (exact: the products are those of a bf16 pool holding the float8 values). On
        AMX a float8 pool's long extends take SDPA, faster there than the vdpbf16ps form."""
        if self.kv_dtype in (None, self.dtype):
            return self.flash
        return self.flash and not self.flash_amx and self.kv_dtype == torch.float8_e4m3fn

    @property
    def _amx_ok(self) -> bool:
        """The AMX form packs the model's dtype only: a float8 pool's long extends take SDPA there
        (faster on AMX than the vdpbf16ps form: 2.9 vs 8.2 ms a layer at 1,024 tokens)."""
        return self.flash_amx and self._flash_ok

    def _in_kernel(self, prefix: int, new: int) -> bool:
        """Whether an extend runs in kvledger's kernels (else in SDPA)."""
        if self._amx_ok or self.deterministic:
            return True
        # Every extend in the kernels by default, long ones too: SDPA's rows sum in another order than
        # the decode and per-token kernels', and a prompt must answer the same whether its rows were
        # computed in one extend, in chunks or as a cache hit's tail. --cpu-amx (sdpa_extends) opts
        # into SDPA for long extends where the tiles' form cannot serve (no AMX, or a float8 pool).
        return not self.sdpa_extends or new < FLASH_MIN_NEW

    def _additive(self, ext: list) -> list:
        """SDPA's extends with each causal-after-prefix mask as an additive one in the model's dtype,
        made once per forward: SDPA turns a boolean mask into one at every call (every layer), ~10%
        of a 512-after-512 extend's attention; the outputs are the same bits."""
        if not self.sdpa_extends:
            return ext
        return [
            (s, n, idx, m if m is None else torch.zeros(m.shape, dtype=self.dtype).masked_fill_(~m, float("-inf")))
            for s, n, idx, m in ext
        ]

    def prepare(self, batch: ForwardBatch) -> None:
        sp = split_batch(batch, self._in_kernel)
        i64, dec = torch.int64, bool(sp.dec_tok)
        short: list[list[int]] = [[], [], [], []]
        long: list[list[int]] = [[], [], [], []]
        for ext in zip(*sp.kernel_ext):  # (row, first token, prefix, new)
            for col, v in zip(long if self._flash_ok and ext[3] >= FLASH_MIN_NEW else short, ext):
                col.append(v)
        batch.attn_meta = _CpuMeta(
            torch.tensor(sp.dec_tok) if dec else None,
            torch.tensor(sp.dec_rows, dtype=i64) if dec else None,
            torch.tensor(sp.dec_lens, dtype=i64) if dec else None,
            tuple(torch.tensor(col, dtype=i64) for col in short) if short[0] else None,
            tuple(torch.tensor(col, dtype=i64) for col in long) if long[0] else None,
            self._additive(sp.sdpa_ext),
            not sp.kernel_ext[0] and not sp.sdpa_ext and len(sp.dec_tok) == batch.num_tokens,
            sparse_meta(sp),
        )
        worker = batch.sparse_worker
        if batch.attn_meta.sparse is not None and worker is not None and worker.in_place_ok(self.dtype):
            # The host pages read in place (csrc/hisparse.cpp): each row's host page ids, once a forward.
            tok, rows, lens = batch.attn_meta.sparse
            host_table, sp_lens = worker.host_table(rows), torch.tensor(lens, dtype=i64)
            worker.in_place_forwards += 1
            batch.attn_meta.sparse = (tok, rows, lens, host_table, sp_lens)
            n = batch.num_tokens
            if not sp.kernel_ext[0] and not sp.sdpa_ext and len(sp.dec_tok) + len(tok) == n == len(batch.req_rows):
                # Decodes only, some HiSparse: the one-call decode takes them all (its rows in batch order).
                batch.attn_meta.one_call_sparse = (
                    torch.tensor(batch.req_rows, dtype=i64), torch.tensor(batch.seq_lens, dtype=i64),
                    (worker.host_k, worker.host_v, worker.summary, tok.to(i64), host_table, sp_lens,
                     worker.one_call_params()),
                )  # fmt: skip
        batch.attn_meta.special = special = self.special_layers(batch)
        if special is not None:
            batch.attn_meta.spans = request_spans(batch)

    def forward(self, layer, q, k, v, kv_buffer, batch):
        k_cache, v_cache = kv_buffer.k[layer], kv_buffer.v[layer]
        meta: _CpuMeta = batch.attn_meta
        table = batch.req_to_token
        window = 0
        if self.is_special(meta.special, layer):
            window = self._kernel_window(layer, meta)
            if not window:
                # The kernels know no soft-capping or sinks: these layers take the reference path.
                self.store(k_cache, v_cache, k, v, batch)
                return self.attend_spans(layer, q, k_cache, v_cache, meta.spans)
        if meta.only_decodes:
            return self.op(
                q, k_cache, v_cache, table, meta.dec_rows, meta.dec_lens, self.scale, k, v, batch.out_loc,
                window=window,
            )  # fmt: skip
        k, v = self.store(k_cache, v_cache, k, v, batch)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if meta.dec_tok is not None:
            out[meta.dec_tok] = self.op(
                q[meta.dec_tok], k_cache, v_cache, table, meta.dec_rows, meta.dec_lens, self.scale, window=window
            )
        if meta.ext is not None:
            self.extend_op(out, q, k_cache, v_cache, table, *meta.ext, self.scale, window)
        if meta.flash is not None:
            if window:  # the flash kernel knows no window: the per-token kernel, the same rows' bits
                self.extend_op(out, q, k_cache, v_cache, table, *meta.flash, self.scale, window)
            else:
                self.flash_op(out, q, k_cache, v_cache, table, *meta.flash, self.scale, self.flash_amx)
        if meta.long_ext:
            attend_extends(out.view_as(q), q, k_cache, v_cache, meta.long_ext, self.scale, k, v)
        if meta.sparse is not None:
            self.sparse_decode(layer, q, k, v, kv_buffer, batch, out, meta.sparse)
        return out

    def store(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch) -> tuple:
        """``TorchAttention.store`` as a copy over the kernels' threads where the pool holds the model's
        dtype (an ATen index write of a 1,024-token prompt's K/V cost ~7% of Gemma 3 270M's prefill)."""
        rows_whole = all(t.stride(-1) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        if k_cache.dtype != k.dtype or batch.out_loc.dtype != torch.int64 or not rows_whole:
            return super().store(k_cache, v_cache, k, v, batch)
        torch.ops.kvledger_cpu.store_kv_(k_cache, v_cache, k, v, batch.out_loc.contiguous())
        return k, v

    def _kernel_window(self, layer: int, meta: _CpuMeta) -> int:
        """A special layer's window where the kernels apply it (they read each query's last ``window``
        keys: the decode, per-token extend and one-call kernels alike), else 0 (the reference path): a
        layer special only by its window (no soft-capping, no sinks), in a forward with no SDPA extends,
        no HiSparse rows and not row by row (deterministic inference)."""
        window = self._window(layer)
        if (
            window is None
            or self.softcap is not None
            or self._sink(layer) is not None
            or meta.long_ext
            or meta.sparse is not None
            or self.row_wise
        ):
            return 0
        return int(window)

    def hisparse_in_place(self, worker) -> bool:
        """The kernel reads the host pool in place wherever the pool is of the model's dtype (``prepare``
        makes the same choice for every forward): only ``hot[0]``, the write page, is ever used."""
        return worker.in_place_ok(self.dtype)

    def sparse_decode(self, layer: int, q, k, v, kv_buffer, batch, out: torch.Tensor, sparse: tuple) -> None:
        """HiSparse rows on the CPU: one kernel call a layer for all of them (selection and attention
        over the host pages in place: ``SparseWorker.attend_in_place``); the torch reference where the
        host pool is not of the model's dtype."""
        if len(sparse) < 5:
            return super().sparse_decode(layer, q, k, v, kv_buffer, batch, out, sparse)
        tok, _, _, host_table, lens = sparse
        o = batch.sparse_worker.attend_in_place(layer, q[tok], k[tok], v[tok], host_table, lens, self.scale)
        out[tok] = o.view(out[tok].shape)

    def attend_pages(self, q, k_cache, v_cache, pages, counts, page_size):
        """The decode kernel over a per-KV-head table of the selected pages (read in place)."""
        from .hisparse import SparseWorker

        r, _, p = pages.shape
        table = SparseWorker.token_table(pages, page_size)
        rows = torch.arange(r, dtype=torch.int64)
        lens = torch.tensor(counts, dtype=torch.int64)
        return self.op(q, k_cache, v_cache, table, rows, lens, self.scale, None, None, None, p * page_size)


def make_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    scale: float | None = None,
    windows: list[int | None] | None = None,
    softcap: float | None = None,
    sdpa_extends: bool = False,
    sinks: list[torch.Tensor | None] | None = None,
    deterministic: bool = False,
) -> AttentionBackend:
    """``torch``: the reference backend; ``cpu``: decodes in kvledger's C++ kernel (``attention_cpu``).
    ``auto`` is resolved by the model (``CausalLM``) before it gets here. ``dtype``: the model's
    (the cpu backend has a bf16-only prefill kernel). ``scale``, ``windows``, ``softcap``, ``sinks``:
    the family's attention (``TorchAttention``). ``sdpa_extends``: the cpu backend runs long extends in
    torch's SDPA (on a CPU with AMX, 2-2.5x its own flash kernel: ``CpuAttention``). ``deterministic``:
    the cpu backend keeps every row in its kernels' one order of sums (``CpuAttention``)."""
    if name == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim, scale, windows, softcap, sinks)
    if name == "cpu":
        return CpuAttention(
            num_heads, num_kv_heads, head_dim, dtype, scale, windows, softcap, sdpa_extends, sinks, deterministic
        )
    raise ValueError(f"unknown attention backend {name!r}; available: torch, cpu")
