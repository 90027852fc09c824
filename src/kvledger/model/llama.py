"""Llama-family forward (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV pool.

Weights are plain tensors, fused where it saves Python ops per step (QKV, gate/up). Only the
positions named in ``batch.logit_index`` go through the final norm and the LM head.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..kernels.quant import PackedWeight
from ..parallel.comm import Comm
from .attention import (
    AttentionBackend,
    KVBuffer,
    attention_context,
    make_backend,
    new_handle,
    paged_attention,
    sdpa_backends,
)
from .attention_cpu import resolve_backend
from .batch import ForwardBatch
from .config import ModelConfig
from .linear import Linear
from .quantized import BlockWeight, Weight, cat_rows, dense


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the scaling types Llama-family checkpoints use."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled)
    raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers (variance in fp32, weight applied in the model dtype).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class _Layer(nn.Module):
    def __init__(self, qkv, o, gate_up, down, in_norm, post_norm, q_norm, k_norm):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.in_norm, self.post_norm = _param(in_norm), _param(post_norm)
        self.q_norm = None if q_norm is None else _param(q_norm)
        self.k_norm = None if k_norm is None else _param(k_norm)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


DECODE_IN_ONE_CALL = True
"""Batches of decodes run every layer in one C++ call (``_Net.decode_step``) where the model allows."""


@dataclass(frozen=True)
class _DecodePlan:
    args: tuple  # kvledger_cpu::decode_layers' weight arguments, in its order
    max_rows: int  # the most rows (decodes) a step may have for it


class _Net(nn.Module):
    """The whole forward as one module, so ``torch.compile`` can freeze its weights (and prepack them
    for oneDNN) and fuse the elementwise work; attention is the opaque op ``kvledger::attention``."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed,
        norm,
        lm_head,
        layers,
        cos,
        sin,
        handle: int,
        comm=None,
        fused: bool = False,
    ):
        """``fused``: eager forwards use kvledger's C++ norm/rotary/SiLU kernels (loaded)."""
        super().__init__()
        self.cfg = cfg
        self.fused = fused
        self.comm = comm or Comm()  # tensor parallel: the O/down all-reduces, vocab-parallel ends
        # The embedding: a dense table, or the tied LM head's int8 blocks (looked up row by row).
        self.embed: torch.Tensor | PackedWeight = embed if isinstance(embed, PackedWeight) else _param(embed)
        self.vocab_rows = embed.out_features if isinstance(embed, PackedWeight) else embed.shape[0]
        self.vocab_start = self.comm.rank * self.vocab_rows
        self.norm = _param(norm)
        self.lm_head = lm_head
        self.layers = nn.ModuleList(layers)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.handle = handle
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @functools.cached_property
    def decode_plan(self) -> _DecodePlan | None:
        """What ``kvledger_cpu::decode_layers`` takes, built once; None where the layers are not all
        the kernel's packed projections without biases or q/k norms, on one rank, with the kernels
        loaded (the Python loop then runs). Projections and weights are not replaced after
        construction (``Linear.unpack`` only touches the bf16 copy)."""
        projs = [p for L in self.layers for p in (L.qkv, L.o, L.gate_up, L.down)]
        if (
            not self.fused
            or self.comm.size > 1
            or any(p.qw is None or p.b is not None for p in projs)
            or any(L.q_norm is not None for L in self.layers)
        ):
            return None
        qw = [p.qw for p in projs]
        args = (
            [q.w for q in qw],
            [q.scales for q in qw],
            [q.wsum128 for q in qw],
            [q.bits for q in qw],
            [q.out_features for q in qw],
            [L.in_norm for L in self.layers],
            [L.post_norm for L in self.layers],
        )
        # Calls from int8_batch_rows rows of a layer with oneDNN's int8 copy go there
        # (Linear._quantized), not the kernel.
        max_rows = min((p.int8_batch_rows - 1 for p in projs if p.w8 is not None), default=1 << 62)
        return _DecodePlan(args, max_rows)

    def decode_step(
        self,
        plan: _DecodePlan,
        input_ids,
        positions,
        logit_index,
        kv_buffer,
        table,
        rows,
        lens,
        out_loc,
        scale,
    ) -> torch.Tensor:
        """The forward of a batch of decodes with every layer in one kernel call; the same ops in the
        same order as ``forward``'s fused path, so the same logits bit for bit."""
        h = self._embed(input_ids)
        torch.ops.kvledger_cpu.decode_layers(
            h, *plan.args, kv_buffer.k, kv_buffer.v, positions, self.cos, self.sin, table, rows, lens, out_loc,
            self.cfg.num_heads, scale, self.cfg.rms_norm_eps,
        )  # fmt: skip
        return self._logits(h, logit_index)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, PackedWeight):
            return self.embed.rows(ids).to(self.norm.dtype)
        return F.embedding(ids, self.embed)

    def dense_embedding(self) -> None:
        """Make the embedding a dense table (``torch.compile`` traces ``F.embedding``, not the lookup
        in packed blocks)."""
        if isinstance(self.embed, PackedWeight):
            self.embed = _param(self.embed.rows().to(device=self.norm.device, dtype=self.norm.dtype))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm.size == 1:
            return self._lookup(input_ids)
        # This rank holds rows [vocab_start, +len) of the embedding.
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)
        h = self._lookup(local.clamp(0, self.vocab_rows - 1)) * inside.unsqueeze(-1)
        return comm.all_reduce(h)

    def _logits(self, h: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows that sample; float32 ``[rows, vocab]``."""
        h = _rms_norm(h[logit_index], self.norm, self.cfg.rms_norm_eps)
        logits = self.lm_head(h).float()
        if self.comm.size > 1:
            logits = self.comm.gather_vocab(logits)[:, : self.cfg.vocab_size]
        return logits

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logit_index: torch.Tensor,
        pool_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits of the ``logit_index`` rows; with ``pool_index``, also those rows' final-norm
        hidden states (float32 ``[rows, hidden]``, what the LM head reads: pooling)."""
        cfg = self.cfg
        T = input_ids.shape[0]
        # The C++ kernels in eager forwards; a compiled graph keeps the torch ops (Inductor fuses them).
        fused = self.fused and not torch.compiler.is_compiling()
        kops = torch.ops.kvledger_cpu if fused else None
        if not fused:
            cos = self.cos[positions].unsqueeze(1)
            sin = self.sin[positions].unsqueeze(1)
        comm = self.comm
        h = self._embed(input_ids)
        eps = cfg.rms_norm_eps
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def add_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor):
            """``h + delta`` and its RMS norm; the kernel adds into ``h`` in place."""
            if fused:
                return h, kops.add_rms_norm(h, delta, w, eps)
            h = h + delta
            return h, _rms_norm(h, w, eps)

        x = (
            kops.rms_norm(h, self.layers[0].in_norm, eps)
            if fused
            else _rms_norm(h, self.layers[0].in_norm, eps)
        )
        n_layers = len(self.layers)
        for i, L in enumerate(self.layers):
            qkv = L.qkv(x)
            q = qkv[:, : self.q_size].view(T, heads, hd)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, kv_heads, hd)
            v = qkv[:, self.q_size + self.kv_size :].view(T, kv_heads, hd)
            if L.q_norm is not None:
                q = _rms_norm(q, L.q_norm, eps)
                k = _rms_norm(k, L.k_norm, eps)
            if fused:  # rotated in place; q and k heads are adjacent in the fused QKV row
                if L.q_norm is None:
                    kops.rope_(
                        qkv[:, : self.q_size + self.kv_size].view(T, heads + kv_heads, hd),
                        positions,
                        self.cos,
                        self.sin,
                    )
                else:
                    kops.rope_(q, positions, self.cos, self.sin)
                    kops.rope_(k, positions, self.cos, self.sin)
            else:
                q = self._rope(q, cos, sin)
                k = self._rope(k, cos, sin)
            o = paged_attention(q, k, v, i, self.handle)
            h, x = add_norm(h, comm.all_reduce(L.o(o)), L.post_norm)
            gu = L.gate_up(x)
            if fused:
                act = kops.silu_mul(gu)
            else:
                g, u = gu.chunk(2, dim=-1)
                act = F.silu(g) * u
            delta = comm.all_reduce(L.down(act))
            if i + 1 < n_layers:
                h, x = add_norm(h, delta, self.layers[i + 1].in_norm)
            else:
                h = h + delta
        logits = self._logits(h, logit_index)
        if pool_index is None:
            return logits
        # Under tensor parallel ``h`` is whole on every rank (the last all-reduce), as is the norm.
        return logits, _rms_norm(h[pool_index], self.norm, cfg.rms_norm_eps).float()


class LlamaModel:
    """A causal LM over a paged KV pool. Holds no global state: several instances may coexist (each
    registers its own attention context under its own handle)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attention: str = "auto",
        quantization: str | None = None,
        comm=None,
        int8_batch: bool = False,
    ):
        """``cfg`` has this rank's shapes and ``weights`` its shards under tensor parallelism
        (``parallel/shard.py``); ``comm`` does the collectives. ``attention``: auto | torch | cpu
        (``resolve_backend``); ``cpu`` also runs the norms, rotary and SiLU in the C++ kernels.
        ``int8_batch``: quantized layers run forwards of ``linear.INT8_BATCH_ROWS`` rows and more
        (prefill chunks) in oneDNN's int8 linear instead of their own kernel."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.attention = resolve_backend(attention, self.device, dtype)
        self.quantization = quantization  # the weight-only mode its linears run in (None: dense)
        self.attn: AttentionBackend = make_backend(
            self.attention, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype
        )

        def take(name: str) -> torch.Tensor:
            try:
                return weights.pop(name)
            except KeyError:
                raise ModelLoadError(f"checkpoint lacks tensor {name}") from None

        def cast(t: Weight) -> torch.Tensor:
            return dense(t).to(device=self.device, dtype=dtype).contiguous()

        def lin(w: Weight, b: Weight | None = None, mode: str | None = quantization) -> Linear:
            bias = None if b is None else cast(b)
            return Linear(w, bias, mode, int8_batch=int8_batch, dtype=dtype, device=self.device)

        raw_embed = take("model.embed_tokens.weight")
        lm_head = weights.pop("lm_head.weight", None)
        tied = lm_head is None or cfg.tie_word_embeddings
        # The LM head is int8 even in int4 mode: it is usually kept at 8 bits in quantized checkpoints
        # (Q8_0 in SmolLM2's GGUF), and its logits are what sampling sees.
        lm_mode = "int8" if quantization == "int4" else quantization
        lm = lin(raw_embed if tied else lm_head, mode=lm_mode)
        # A tied Q8_0 embedding is looked up in the LM head's copy of the file's blocks (the same
        # values, no second copy of the largest matrix); otherwise it is a dense table.
        shared = tied and isinstance(raw_embed, BlockWeight) and raw_embed.kind == "Q8_0" and lm.qw is not None
        embed = lm.qw if shared else cast(raw_embed)
        del raw_embed, lm_head
        norm = cast(take("model.norm.weight"))
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            qkv_b = None
            if cfg.attention_bias:
                qkv_b = torch.cat([dense(take(p + f"self_attn.{n}_proj.bias")) for n in "qkv"])
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            layers.append(
                _Layer(
                    qkv=lin(cat_rows([q, k, v]), qkv_b),
                    o=lin(take(p + "self_attn.o_proj.weight")),
                    gate_up=lin(cat_rows([gate, up])),
                    down=lin(take(p + "mlp.down_proj.weight")),
                    in_norm=cast(take(p + "input_layernorm.weight")),
                    post_norm=cast(take(p + "post_attention_layernorm.weight")),
                    q_norm=cast(take(p + "self_attn.q_norm.weight")) if cfg.qk_norm else None,
                    k_norm=cast(take(p + "self_attn.k_norm.weight")) if cfg.qk_norm else None,
                )
            )
        inv = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        self.handle = new_handle()
        self.net = _Net(
            cfg,
            embed,
            norm,
            lm,
            layers,
            freqs.cos().to(self.device, dtype),
            freqs.sin().to(self.device, dtype),
            self.handle,
            comm,
            fused=self.attention == "cpu",
        ).eval()
        self.compiled: nn.Module | None = None
        self.compiled_forwards = 0  # forwards that ran through the compiled graph
        self.one_call_forwards = 0  # batches of decodes whose layers ran in one kernel call

    def enable_compile(self) -> None:
        """Run forwards through ``torch.compile`` (dynamic token count; weights frozen and prepacked).
        Compilation happens on the first forwards of each new shape class (tens of seconds)."""
        for m in self.net.modules():
            if isinstance(m, Linear):
                m.unpack()
        self.net.dense_embedding()
        self.compiled = torch.compile(self.net, dynamic=True, options={"freezing": True})

    def compile_stats(self) -> dict:
        """This model's forwards through the compiled graph, and this process's dynamo counts (graphs
        compiled, frames traced): after the warm-up, neither count should move."""
        from torch._dynamo.utils import counters

        return {
            "compiled_forwards": self.compiled_forwards,
            "graphs": counters["stats"]["unique_graphs"],
            "frames": counters["frames"]["total"],
        }

    def weight_bytes(self) -> int:
        """Bytes of all weights held (int8 copies included; a tied LM head counted once)."""
        seen: set[int] = set()
        n = 0
        for t in [*self.net.parameters(), *self.net.buffers()]:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                n += t.untyped_storage().nbytes()
        return n + sum(m.packed_bytes() for m in self.net.modules() if isinstance(m, Linear))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_buffer: KVBuffer, connector=None) -> torch.Tensor:
        """Run one mixed batch; returns float32 logits ``[len(batch.logit_index), vocab]``.
        ``connector``: a KV connector's worker side, called per layer (see ``connector/base.py``)."""
        assert batch.pool_index is None, "a batch that pools runs through forward_pooled"
        return self._forward(batch, kv_buffer, connector)

    @torch.inference_mode()
    def forward_pooled(
        self, batch: ForwardBatch, kv_buffer: KVBuffer, connector=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, plus the final-norm hidden states of the ``batch.pool_index`` rows (float32)."""
        return self._forward(batch, kv_buffer, connector)

    def _forward(self, batch: ForwardBatch, kv_buffer: KVBuffer, connector):
        self.attn.prepare(batch)
        pool = batch.pool_index
        # Only forwards that sample several rows go through the compiled graph: dynamo specializes
        # sizes 0 and 1, so routing single-request forwards there too would compile two more graphs
        # (tens of seconds each) for little gain (one request is weight-bandwidth bound). A forward
        # that pools runs eager: its second output would be a second graph.
        use = (
            self.compiled is not None
            and pool is None
            and batch.lora is None  # adapter rows run eager: LoRA deltas live in the projections' calls
            and batch.num_tokens > 1
            and batch.logit_index.shape[0] > 1
        )
        net = self.compiled if use else self.net
        self.compiled_forwards += use
        meta = batch.attn_meta
        if (
            not use
            and pool is None
            and connector is None
            and batch.lora is None  # the one-call decode bypasses the projections (and their LoRA deltas)
            and DECODE_IN_ONE_CALL
            and getattr(meta, "only_decodes", False)
        ):
            plan = self.net.decode_plan
            if plan is not None and batch.num_tokens <= plan.max_rows:
                self.one_call_forwards += 1
                return self.net.decode_step(
                    plan, batch.input_ids, batch.positions, batch.logit_index, kv_buffer, batch.req_to_token,
                    meta.dec_rows, meta.dec_lens, batch.out_loc, self.attn.scale,
                )  # fmt: skip
        with (
            attention_context(self.handle, self.attn, kv_buffer, batch, connector),
            sdpa_backends(self.device),
        ):
            if pool is None:
                return net(batch.input_ids, batch.positions, batch.logit_index)
            return net(batch.input_ids, batch.positions, batch.logit_index, pool)
