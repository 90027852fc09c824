"""HiSparse's data plane (the worker side): sparse decode attention over a hot page budget, with the
whole KV history in a host pool.

Per sparse request slot (``_SlotState``): the host pages that hold its KV (page i of the sequence in
``host[i]``; the pool's K/V live here, ``[host pages, layers, kv heads, page_size, head_dim]``), a
summary of each page's keys per layer and KV head (the element-wise min and max: Quest, Tang et al.
2024), and per (layer, KV head) which page each hot slot holds, with LRU stamps. ``hot[0]`` is the
page being written; ``hot[1:]`` cache the pages attention selected.

Each decode step, per layer, for each sparse row: the new token's K/V (already stored in ``hot[0]``)
is backed up to its host page and folded into that page's summary; the pages attention reads are
chosen — the first ``sink`` pages, the last ``recent`` (the current one included) and the ``top_k``
others whose Quest bound ``sum_d max(q_d min_d, q_d max_d)`` (the largest of the KV head's query
heads') is largest — misses are copied from host into the least recently used hot slots, and attention reads
the selected hot pages in place through a per-KV-head page table (the C++ kernel, or the torch
reference: a gather of whole pages, as its dense decode does). When a sequence has no more pages than
``sink + recent + top_k`` every page is selected, in order: the same sums as dense attention.

The scheduler's books (``memory/sparse_kv.py``) decide which pages each slot owns; this module only
moves bytes where a step's ``SparseStep`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..memory.pools import zeroed_host_tensor

_NEVER = np.iinfo(np.int64).max  # the stamp of a slot that must not be evicted this step


@dataclass
class _SlotState:
    host: torch.Tensor  # int64 [reserved pages]: host page of each sequence page
    hot: list[int]  # KV-pool pages: hot[0] the write page
    where: np.ndarray  # int32 [layers, kv_heads, reserved pages]: hot slot holding the page, or -1
    slot_page: np.ndarray  # int32 [layers, kv_heads, hot]: the page in each hot slot, or -1
    stamp: np.ndarray  # int64 [layers, kv_heads, hot]: last step each hot slot was read (-1: never)
    tick: int = 0

    def __post_init__(self) -> None:
        self.hot_ids = np.asarray(self.hot, dtype=np.int64)  # (``hot`` as an index, made once)


class SparseWorker:
    """The host pool's K/V and every sparse slot's state; ``apply`` a step's ops, ``attend`` a layer."""

    def __init__(self, cfg, num_host_pages: int, num_layers: int, kv_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype):  # fmt: skip
        shape = (num_host_pages, num_layers, kv_heads, page_size, head_dim)
        # Zero pages from the OS as they are first touched: a host pool of gigabytes costs nothing idle.
        self.host_k = zeroed_host_tensor(shape, dtype)
        self.host_v = zeroed_host_tensor(shape, dtype)
        # Each host page's key summary per layer and KV head (element-wise min, max: Quest), kept with the
        # pool rather than the slot, so one kernel call reads every row's through its host page ids. Layer
        # first, so that a layer's summaries of a row's pages lie together (the kernel streams them once a
        # layer), and in the pool's dtype where that holds every key exactly (the min and max of bfloat16
        # keys are bfloat16 values: half float32's bytes, nothing lost); float32 for other dtypes.
        sdtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        self.summary = zeroed_host_tensor((num_layers, num_host_pages, kv_heads, 2, head_dim), sdtype)
        self.layers, self.kv_heads, self.head_dim, self.page_size = num_layers, kv_heads, head_dim, page_size
        self.sink, self.recent = cfg.hisparse_sink_pages, cfg.hisparse_recent_pages
        self.top_k = cfg.top_k_pages(page_size)
        self.dense_layers = cfg.hisparse_dense_layers  # the first layers read every page
        self.slots: dict[int, _SlotState] = {}
        self.hits = self.misses = 0  # hot-slot lookups of selected pages (not the write page)
        self.in_place_forwards = 0  # forwards whose sparse rows read the host pool in place (the C++ kernel)

    # -- a step's ops ----------------------------------------------------------------------------------
    def apply(self, step, kv_buffer) -> None:
        """Ends first (a slot reused in this step starts clean), then begins."""
        for slot in step.ends:
            self.slots.pop(slot, None)
        for b in step.begins:
            self._begin(b, kv_buffer)
        missing = [s for s in step.rows if s not in self.slots]
        if missing:
            raise RuntimeError(f"HiSparse rows without a sparse state: slots {missing}")

    def write(self, locs: torch.Tensor, blk: torch.Tensor) -> None:
        """KV arriving from a PD prefill server, straight into host pages: ``blk`` ``[2, layers, heads,
        len(locs), head_dim]`` at host locations ``locs`` (``page * page_size + offset``)."""
        pages, offs = locs // self.page_size, locs % self.page_size
        self.host_k[pages, :, :, offs] = blk[0].permute(2, 0, 1, 3)
        self.host_v[pages, :, :, offs] = blk[1].permute(2, 0, 1, 3)

    def _begin(self, b, kv_buffer) -> None:
        """Copy the first ``b.kv_len`` tokens' KV from the KV pool into the host pages (those from page
        ``b.in_host_from`` on are there already: KV a PD prefill server sent), summarise each page's
        keys, and put the partial last page into ``hot[0]`` (the step writes after it)."""
        ps, d, kvh = self.page_size, self.head_dim, self.kv_heads
        n = -(-b.kv_len // ps)
        m = n if b.in_host_from is None else min(n, b.in_host_from)  # pages still in the KV pool
        reserved = len(b.host_pages)
        st = _SlotState(
            torch.tensor(b.host_pages, dtype=torch.int64),
            list(b.hot_pages),
            np.full((self.layers, kvh, reserved), -1, dtype=np.int32),
            np.full((self.layers, kvh, len(b.hot_pages)), -1, dtype=np.int32),
            np.full((self.layers, kvh, len(b.hot_pages)), -1, dtype=np.int64),
        )
        if n:
            dense = torch.tensor(b.dense_pages[:m], dtype=torch.int64)
            host = st.host[:n]
            valid = b.kv_len - (n - 1) * ps  # tokens of the last page
            for layer in range(self.layers):
                if m:
                    kc = kv_buffer.k[layer].view(kvh, -1, ps, d).index_select(1, dense)  # [KVH, m, ps, D]
                    vc = kv_buffer.v[layer].view(kvh, -1, ps, d).index_select(1, dense)
                    self.host_k[host[:m], layer] = kc.transpose(0, 1)
                    self.host_v[host[:m], layer] = vc.transpose(0, 1)
                kf = self.host_k[host, layer].transpose(0, 1).float()  # [KVH, n, ps, D]
                lo, hi = kf.amin(2), kf.amax(2)  # [KVH, n, D]
                last = kf[:, n - 1, :valid]
                lo[:, n - 1], hi[:, n - 1] = last.amin(1), last.amax(1)
                self.summary[layer, host] = torch.stack([lo, hi], 2).transpose(0, 1).to(self.summary.dtype)
            if valid < ps:
                w = st.hot[0] * ps
                last_host = int(st.host[n - 1])
                for layer in range(self.layers):
                    kv_buffer.k[layer, :, w : w + ps] = self.host_k[last_host, layer]
                    kv_buffer.v[layer, :, w : w + ps] = self.host_v[last_host, layer]
        self.slots[b.slot] = st

    # -- one layer of a forward ------------------------------------------------------------------------
    def select(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               slots: list[int], lens: list[int], kv_buffer) -> tuple[torch.Tensor, list[int], bool]:  # fmt: skip
        """The reference path (the torch backend; a device's KV pool): for rows ``slots`` (sequence
        lengths ``lens``, the new token included, whose K/V ``k_new``/``v_new`` ``[R, KVH, D]`` are in
        their write page): back up, choose pages, fill hot slots. Returns the pages each row's KV heads
        read, int64 ``[R, KVH, P]`` (rows with fewer pages padded with their last), each row's token
        count over them, and whether they are host pages (a dense layer: every page, read from the host
        pool) rather than KV-pool pages."""
        ps, d, kvh = self.page_size, self.head_dim, self.kv_heads
        dense = layer < self.dense_layers
        group = q.shape[1] // kvh
        pages_out: list[np.ndarray] = []
        counts: list[int] = []
        for r, (slot, n_tok) in enumerate(zip(slots, lens)):
            st = self.slots[slot]
            pos = n_tok - 1
            cur, off = pos // ps, pos % ps
            hp = int(st.host[cur])
            self.host_k[hp, layer, :, off] = k_new[r]
            self.host_v[hp, layer, :, off] = v_new[r]
            kf = self.host_k[hp, layer, :, off].to(self.summary.dtype)  # the key as stored (exact)
            s = self.summary[layer, hp]  # [KVH, 2, D]
            if off == 0:
                s[:, 0], s[:, 1] = kf, kf
            else:
                torch.minimum(s[:, 0], kf, out=s[:, 0])
                torch.maximum(s[:, 1], kf, out=s[:, 1])
            n_pages = cur + 1
            if dense:
                table = np.broadcast_to(st.host[:n_pages].numpy(), (kvh, n_pages))
                pages_out.append(table)
                counts.append(cur * ps + off + 1)
                continue
            if n_pages <= self.sink + self.recent + self.top_k:
                chosen = np.broadcast_to(np.arange(cur, dtype=np.int64), (kvh, cur))
            else:
                chosen = self._top_pages(st, layer, q[r].view(kvh, group, d), n_pages)
            st.tick += 1
            table = np.empty((kvh, chosen.shape[1] + 1), dtype=np.int64)
            for h in range(kvh):
                table[h, :-1] = self._place(st, layer, h, chosen[h], kv_buffer)
            table[:, -1] = st.hot[0]
            pages_out.append(table)
            counts.append(chosen.shape[1] * ps + off + 1)
        width = max(t.shape[1] for t in pages_out)
        out = np.empty((len(slots), kvh, width), dtype=np.int64)
        for r, t in enumerate(pages_out):
            out[r, :, : t.shape[1]] = t
            out[r, :, t.shape[1] :] = t[:, -1:]  # (padding past the row's count is never read)
        return torch.from_numpy(out), counts, dense

    def _top_pages(self, st: _SlotState, layer: int, q: torch.Tensor, n_pages: int) -> np.ndarray:
        """Per KV head the pages before the current one to read, ascending (``quest_pages``)."""
        return quest_pages(self.summary, st.host, layer, q, n_pages, self.sink, self.recent, self.top_k)

    def _place(self, st: _SlotState, layer: int, h: int, pages: np.ndarray, kv_buffer) -> np.ndarray:
        """The KV-pool page holding each of ``pages`` for (layer, KV head h): hits where they are,
        misses copied from host into the least recently used hot slots."""
        where = st.where[layer, h]
        js = where[pages].astype(np.int64)
        miss = js < 0
        n_miss = int(miss.sum())
        self.hits += len(pages) - n_miss
        if n_miss:
            self.misses += n_miss
            stamp = st.stamp[layer, h].copy()
            stamp[0] = _NEVER  # the write page
            stamp[js[~miss]] = _NEVER  # read this step
            victims = np.argpartition(stamp, n_miss - 1)[:n_miss] if n_miss < len(stamp) else np.arange(len(stamp))
            new_pages = pages[miss]
            for page, j in zip(new_pages.tolist(), victims.tolist()):
                old = st.slot_page[layer, h, j]
                if old >= 0:
                    where[old] = -1
                st.slot_page[layer, h, j] = page
                where[page] = j
            ps, d = self.page_size, self.head_dim
            hot = torch.from_numpy(st.hot_ids[victims])
            src = st.host[torch.from_numpy(new_pages)]
            kv_buffer.k[layer, h].view(-1, ps, d).index_copy_(0, hot, self.host_k[src, layer, h])
            kv_buffer.v[layer, h].view(-1, ps, d).index_copy_(0, hot, self.host_v[src, layer, h])
            js[miss] = victims
        st.stamp[layer, h, js] = st.tick
        return st.hot_ids[js]

    # -- on the CPU: the host pages read in place, one kernel call a layer -------------------------------
    def host_table(self, slots: list[int]) -> torch.Tensor:
        """int64 ``[R, reserved pages]``: each row's host page ids (a forward's, made once for its layers)."""
        hosts = [self.slots[s].host for s in slots]
        width = max(len(h) for h in hosts)
        out = torch.zeros(len(hosts), width, dtype=torch.int64)
        for r, h in enumerate(hosts):
            out[r, : len(h)] = h
        return out

    def attend_in_place(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        host_table: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        """The C++ kernel (csrc/hisparse.cpp) for every sparse row of layer ``layer``: back up the new
        K/V into its host page and fold it into the page's summary, choose each KV head's pages (all
        of them in a dense layer), and attend over them where they lie in the host pool. ``[R, H * D]``."""
        top_k = -1 if layer < self.dense_layers else self.top_k
        return torch.ops.kvledger_cpu.hisparse_attention(
            q, k_new, v_new, self.host_k, self.host_v, self.summary, layer, host_table, lens,
            self.sink, self.recent, top_k, scale,
        )  # fmt: skip

    def one_call_params(self) -> list[int]:
        """``decode_layers``' ``sp_params``: sink, recent, top-k pages, dense layers."""
        return [self.sink, self.recent, self.top_k, self.dense_layers]

    def in_place_ok(self, dtype: torch.dtype) -> bool:
        """The kernel reads the host pool in place: a CPU pool of the model's ``dtype`` (float32/bfloat16;
        a float8 KV pool's host copy takes the reference path)."""
        return self.host_k.device.type == "cpu" and self.host_k.dtype == dtype and dtype in (
            torch.float32, torch.bfloat16)

    # -- attention over the selected pages -----------------------------------------------------------
    @staticmethod
    def token_table(pages: torch.Tensor, page_size: int) -> torch.Tensor:
        """``[R, KVH, P]`` pages -> ``[R, KVH * P * page_size]`` token locations (a per-KV-head table for
        the C++ kernel: head h's run starts at ``h * P * page_size``)."""
        r, kvh, p = pages.shape
        offs = torch.arange(page_size, dtype=torch.int64)
        return (pages.unsqueeze(-1) * page_size + offs).view(r, kvh * p * page_size)

    def attend_host_torch(self, q: torch.Tensor, layer: int, pages: torch.Tensor, counts: list[int],
                          scale: float) -> torch.Tensor:  # fmt: skip
        """The torch reference over host ``pages`` ``[R, KVH, P]`` of ``layer`` (a dense layer's)."""
        r, kvh, p = pages.shape
        ps, d = self.page_size, self.head_dim
        kd = torch.stack([self.host_k[pages[:, h].flatten(), layer, h] for h in range(kvh)]).to(q.device)
        vd = torch.stack([self.host_v[pages[:, h].flatten(), layer, h] for h in range(kvh)]).to(q.device)
        return SparseWorker._attend(q, kd.view(kvh, r, p * ps, d), vd.view(kvh, r, p * ps, d), counts, scale)

    @staticmethod
    def attend_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                     counts: list[int], page_size: int, scale: float) -> torch.Tensor:  # fmt: skip
        """The torch reference over the selected pages: the same gather of whole pages and the same
        math as ``TorchAttention``'s dense decode (so all pages selected gives its sums)."""
        r, kvh, p = pages.shape
        d = q.shape[2]
        ps = page_size
        kd = torch.stack([k_cache[h].view(-1, ps * d).index_select(0, pages[:, h].flatten()) for h in range(kvh)])
        vd = torch.stack([v_cache[h].view(-1, ps * d).index_select(0, pages[:, h].flatten()) for h in range(kvh)])
        return SparseWorker._attend(q, kd.view(kvh, r, p * ps, d), vd.view(kvh, r, p * ps, d), counts, scale)

    @staticmethod
    def _attend(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, counts: list[int], scale: float) -> torch.Tensor:
        """``q`` ``[R, H, D]`` over gathered ``kd``/``vd`` ``[KVH, R, P * page_size, D]``, the first
        ``counts[r]`` tokens of row r."""
        kvh, r, n_all, d = kd.shape
        heads = q.shape[1]
        group = heads // kvh
        if r == 1:
            n = counts[0]
            qd = q.view(1, kvh, group, d)
            o = F.scaled_dot_product_attention(qd, kd[:, :, :n].transpose(0, 1), vd[:, :, :n].transpose(0, 1), scale=scale)
            return o.reshape(1, heads * d)
        lens = torch.tensor(counts)
        valid = torch.arange(n_all).unsqueeze(0) < lens.unsqueeze(1)
        mask = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))[None, :, None, :]
        qd = q.view(r, kvh, group, d).transpose(0, 1)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).float() * scale + mask
        probs = torch.softmax(scores, dim=-1).to(vd.dtype)
        return torch.matmul(probs, vd).permute(1, 0, 2, 3).reshape(r, heads * d)

    def live_slots(self) -> set[int]:
        return set(self.slots)


def quest_pages(summary: torch.Tensor, host: torch.Tensor, layer: int, q: torch.Tensor, n_pages: int, sink: int,
                recent: int, top_k: int) -> np.ndarray:  # fmt: skip
    """The torch reference of the page choice (csrc/hisparse.cpp's, which tests compare with it): per KV
    head the pages before the current one to read, ascending: the ``sink`` first, the ``top_k`` middle
    pages by Quest's bound, the ``recent - 1`` before the current one. ``summary``: the pool's
    ``[layers, host pages, KVH, 2, D]``; ``host``: the row's host page of each sequence page; ``q``:
    ``[KVH, group, D]``. A sequence of no more than sink + recent + top_k pages reads every one."""
    kvh = q.shape[0]
    if n_pages <= sink + recent + top_k:
        return np.broadcast_to(np.arange(n_pages - 1, dtype=np.int64), (kvh, n_pages - 1))
    qf = q.float()
    # max(q*lo, q*hi) = min(q, 0)*lo + max(q, 0)*hi: each query head's bound in one product; a
    # page's score for its KV head is the largest of its query heads' (a page one head needs is
    # read: a sum would let the others' indifference drown it).
    qq = torch.cat([qf.clamp(max=0), qf.clamp(min=0)], -1).transpose(1, 2)  # [KVH, 2D, group]
    lo, hi = sink, n_pages - recent
    summ = summary[layer, host[lo:hi]].float().transpose(0, 1).reshape(kvh, hi - lo, -1)  # [KVH, mid, 2D]
    scores = torch.bmm(summ, qq).amax(-1)  # [KVH, mid]
    top = scores.topk(top_k, dim=-1).indices.numpy() + lo
    top.sort(axis=1)
    sinks = np.broadcast_to(np.arange(lo, dtype=np.int64), (kvh, lo))
    recents = np.broadcast_to(np.arange(hi, n_pages - 1, dtype=np.int64), (kvh, n_pages - 1 - hi))
    return np.concatenate([sinks, top, recents], axis=1)
