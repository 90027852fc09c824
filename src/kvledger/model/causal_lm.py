"""The engine's model: one family's network (``models/``, picked by the registry) over a paged KV
pool, with its attention backend, the ``torch.compile`` route and the one-call decode route.

Only the positions named in ``batch.logit_index`` go through the final norm and the LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..errors import ModelLoadError
from ..kernels.gguf_weight import GgufWeight
from ..kernels.quant import PackedWeight
from .attention import AttentionBackend, KVBuffer
from .attention_context import attention_context, new_handle, sdpa_backends
from .attention_cpu import make_backend, resolve_backend
from .batch import ForwardBatch
from .config import ModelConfig
from .layers import MoE
from .layers.embedding import spliced
from .layers.rotary import mrope_positions
from .linear import Linear, place_packed_weights, use_amx
from .models.builder import Builder
from .models.registry import family_for, supported

DECODE_IN_ONE_CALL = True
"""Batches of decodes run every layer in one C++ call (``models/one_call.py``) where the model allows."""


class CausalLM:
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
        cpu_amx: str = "off",
        deterministic: bool = False,
    ):
        """``cfg`` has this rank's shapes and ``weights`` its shards under tensor parallelism
        (``parallel/shard.py``); ``comm`` does the collectives. ``attention``: auto | torch | cpu
        (``resolve_backend``); ``cpu`` also runs the Llama family's norms, rotary and SiLU in the C++ kernels.
        ``int8_batch``: quantized layers run forwards of ``linear.INT8_BATCH_ROWS`` rows and more
        (``INT8_VNNI_ROWS`` on kvledger's VNNI int8 kernel) in an int8 linear (``quant.Int8Weight``)
        instead of their own kernel. ``cpu_amx``:
        auto | on | off, whether large calls take oneDNN's bf16 GEMM and SDPA (``linear.use_amx``).
        ``deterministic`` (``--enable-deterministic-inference``): every call on kernels whose sums have one
        order per row (the cpu backend, no AMX paths, dense layers on the dense kernel, windowed/sink
        attention and MoE experts one row at a time): a row's logits do not depend on the rest of the batch."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.deterministic = deterministic
        self.attention = resolve_backend(attention, self.device, dtype, deterministic)
        self.quantization = quantization  # the weight-only mode its linears run in (None: dense)
        self.amx = use_amx(cpu_amx, self.device, dtype, quantization) and not deterministic
        family = family_for(cfg.arch)
        if family is None:
            raise ModelLoadError(
                f"unsupported architecture {cfg.arch!r}; supported: {', '.join(supported())}"
            )
        self.family = family
        self.handle = new_handle()
        comm = comm or Comm()
        builder = Builder(
            cfg,
            weights,
            dtype,
            self.device,
            quantization,
            int8_batch,
            comm,
            self.handle,
            fused=self.attention == "cpu",
            amx=self.amx,
            deterministic=deterministic,
        )
        self.net = family.build(builder).eval()
        if deterministic:
            for m in self.net.modules():
                if isinstance(m, MoE):
                    m.row_wise = True
        if self.device.type == "cpu" and quantization is not None:
            place_packed_weights(self.net)  # in huge pages: a decode step reads them all
        # After the build: attention sinks are weights (the backend reads the layers' own tensors).
        self.attn: AttentionBackend = make_backend(
            self.attention,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            scale=family.attention_scale(cfg),
            windows=cfg.layer_windows(),
            softcap=family.attention_softcap(cfg),
            sdpa_extends=self.amx,
            sinks=self.net.attention_sinks(),
            deterministic=deterministic,
        )
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
        n += sum(m.packed_bytes() for m in self.net.modules() if isinstance(m, Linear))
        # an untied embedding kept as the file's blocks (a tied one is the LM head's copy, counted above)
        emb = self.net.embed.weight
        if isinstance(emb, (PackedWeight, GgufWeight)) and emb is not self.net.lm_head.linear.qw:
            n += emb.nbytes()
        return n

    def greedy_head(self, rows: int) -> bool:
        """Whether a forward of ``rows`` sampled rows may return greedy tokens (``forward(greedy=True)``):
        eager (no compiled graph) and the head's kernel serves them (``LMHead.greedy_in_kernel``)."""
        return self.compiled is None and self.net.lm_head.greedy_in_kernel(rows)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_buffer: KVBuffer, connector=None, greedy: bool = False
    ) -> torch.Tensor:
        """Run one mixed batch; returns float32 logits ``[len(batch.logit_index), vocab]``, or with
        ``greedy`` (where ``greedy_head``) each row's greedy token, int64 ``[len(batch.logit_index)]``,
        the vocabulary's logits never materialized. ``connector``: a KV connector's worker side,
        called per layer (see ``connector/base.py``)."""
        if batch.pool_index is not None:
            raise ValueError("a batch that pools runs through forward_pooled")
        return self._forward(batch, kv_buffer, connector, greedy)

    @torch.inference_mode()
    def forward_pooled(
        self, batch: ForwardBatch, kv_buffer: KVBuffer, connector=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, plus the final-norm hidden states of the ``batch.pool_index`` rows (float32)."""
        return self._forward(batch, kv_buffer, connector)

    def _forward(self, batch: ForwardBatch, kv_buffer: KVBuffer, connector, greedy: bool = False):
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
            and not greedy
            and batch.mm_index is None  # image embeddings are spliced in eager forwards
            and batch.mrope_positions is None  # (and M-RoPE's three positions read there)
        )
        net = self.compiled if use else self.net
        self.compiled_forwards += use
        meta = batch.attn_meta
        if (
            not use
            and pool is None
            and connector is None
            and batch.lora is None  # the one-call decode bypasses the projections (and their LoRA deltas)
            and batch.mm_index is None  # (a one-token prefill chunk of an image's tokens)
            and batch.mrope_positions is None  # (its kernel turns one position a token)
            and DECODE_IN_ONE_CALL
            and (getattr(meta, "only_decodes", False) or getattr(meta, "one_call_sparse", None) is not None)
        ):
            plan = self.net.decode_plan
            # A plan exists only without soft-capping or sinks: a batch with special layers has them
            # for a window that cuts, which the call applies where the plan has windows.
            if (
                plan is not None
                and batch.num_tokens <= plan.max_rows
                and (meta.special is None or plan.windows)
            ):
                self.one_call_forwards += 1
                rows, lens, sparse = meta.dec_rows, meta.dec_lens, ()
                if not meta.only_decodes:  # HiSparse rows among the decodes: every row, in batch order
                    rows, lens, sparse = meta.one_call_sparse
                return self.net.decode_step(
                    plan, batch.input_ids, batch.positions, batch.logit_index, kv_buffer, batch.req_to_token,
                    rows, lens, batch.out_loc, self.attn.scale, greedy, sparse,
                )  # fmt: skip
        with (
            attention_context(self.handle, self.attn, kv_buffer, batch, connector),
            sdpa_backends(self.device),
            spliced(batch.mm_index, batch.mm_rows),
            mrope_positions(batch.mrope_positions),
        ):
            if pool is None:
                if greedy:
                    return net(batch.input_ids, batch.positions, batch.logit_index, greedy=True)
                return net(batch.input_ids, batch.positions, batch.logit_index)
            return net(batch.input_ids, batch.positions, batch.logit_index, pool)


LlamaModel = CausalLM
"""The name this class had while it served only the Llama family."""
