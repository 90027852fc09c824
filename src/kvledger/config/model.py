"""The sections of what runs and how the forward runs: ``ModelSettings`` (the model, the device,
the precision), ``KernelSettings`` (attention backend, compile, CUDA graphs, sampling's side) and
``LoraSettings`` (the adapters)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ValidationError
from .base import (
    ATTENTION_BACKENDS,
    CHAT_TEMPLATES,
    CPU_AMX,
    DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SAMPLING_BACKENDS,
    _norm,
    _one_of,
    _positive,
    setting,
)


@dataclass
class ModelSettings:
    """What runs, where, in which precision."""

    model: str | None = setting(None, "GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)", flags=("--model", "--model-path"))
    device: str = setting("cpu", "cpu (default) | cuda | cuda:N | auto (a CUDA device where torch sees one, else cpu)")
    """cpu | cuda | cuda:N | auto (the first CUDA device where torch sees one, else the CPU). On CUDA
    the model runs in torch (SDPA attention, bf16 GEMMs; weights served unquantized) and sampling
    stays on the host. The default stays cpu: a GPU is opt-in."""
    dtype: str = setting("auto", (
        "auto (default: the faster one on this machine) | float32 (the token-exact reference) | "
        "bfloat16"
    ), choices=DTYPES)
    quantization: str | None = setting("auto", (
        "weight-only int8 / int4 linear layers in GGUF's blocks of 32 (Q8_0 / Q4_1-exact; CPU only, "
        "needs bfloat16). auto (default): a quantized GGUF in its own precision (Q4 -> int4, Q5-Q8 -> "
        "int8) when the dtype is bfloat16"
    ), choices=QUANTIZATIONS)
    """auto | none | int8 | int4. Weight-only quantized linear layers in GGUF's blocks of 32 (int4 =
    Q4_1: a Q4_1 file's own weights; int8 = Q8_0; the LM head stays int8), CPU only, needs bfloat16.
    Where kvledger's CPU kernels load they serve every forward (int8 activations per block of 32,
    llama.cpp's scheme; faster than the bf16 GEMM at every batch size here); otherwise torch's
    weight-only kernels serve forwards of at most 4 rows and the bf16 GEMM the rest.
    auto: the checkpoint's own precision where the dtype is bfloat16 (a Q4 GGUF -> int4, Q5/Q6/Q8 ->
    int8, float checkpoints none); none with float32. Output within the tolerance in
    docs/architecture.md, not token-exact. None = none."""
    context_length: int | None = setting(None, "longest sequence, prompt + output (default: the model's own limit)")
    reasoning_parser: str | None = setting(None, (
        "the model's reasoning markers (<think>...</think>): chat answers give them as "
        "reasoning_content, and a request's grammar starts after </think>"
    ), choices=REASONING_PARSERS)
    """None | deepseek-r1 | qwen3: how the model marks its reasoning (``<think>``...``</think>``). The
    chat API then answers it as ``reasoning_content``, and a request's grammar (structured output,
    tool calls) starts after the end of the reasoning (the engine gates it on ``</think>``'s ids)."""

    chat_template: str | None = setting(None, (
        "the chat template: a Jinja file, or a built-in (" + ", ".join(CHAT_TEMPLATES) + "); default: "
        "the model's own (a GGUF's tokenizer.chat_template, else the Hugging Face tokenizer config)"
    ), metavar="FILE|NAME")
    """A Jinja file or a built-in name (``model/chat_templates.py``), for a model that carries no template
    (or the wrong one). It wins over the model's own; read and tried once at start (a bad one stops the
    start). Its end-of-turn tokens (``<end_of_turn>``, ``<|im_end|>``, ``<|eot_id|>``...) stop generation."""

    def __post_init__(self) -> None:
        self.device = _norm(self.device) or "cpu"
        self.dtype = _norm(self.dtype) or "auto"
        self.quantization = _norm(self.quantization, null=("none",))
        self.reasoning_parser = _norm(self.reasoning_parser, null=("none", "null", ""))

    @property
    def explicit_quantization(self) -> str | None:
        """The quantization asked for by name (int8/int4), before ``auto`` is resolved against a model."""
        return self.quantization if self.quantization in ("int8", "int4") else None

    def check(self) -> None:
        _one_of(self.dtype, DTYPES, "dtype")
        _one_of(self.quantization, QUANTIZATIONS, "quantization", optional=True)
        _one_of(self.reasoning_parser, REASONING_PARSERS, "reasoning_parser", optional=True)
        if self.chat_template is not None and not str(self.chat_template).strip():
            raise ValidationError(
                f"chat_template must be a file or one of {', '.join(CHAT_TEMPLATES)}, got ''", param="chat_template"
            )
        _positive(self, "context_length")


@dataclass
class KernelSettings:
    """How the forward runs: attention backend, int8 batches, torch.compile, where sampling runs,
    CUDA graphs."""

    attention_backend: str = setting("auto", (
        "cpu: kvledger's C++ kernels (paged decode attention in place, fused norm/rotary/SiLU; built "
        "on first use, ~1 min, cached); auto (default): cpu for bfloat16 on a CPU where they build"
    ), choices=ATTENTION_BACKENDS)
    """auto | torch | cpu. cpu: kvledger's C++ kernels (decode attention over the pages in place,
    fused norm/rotary/SiLU); auto picks it for bfloat16 on a CPU where they build, torch otherwise."""
    enable_int8_batch: bool = setting(False, (
        "with a quantization: forwards of 128 rows and more (prefill chunks) in an int8 linear, int8 "
        "activations per token (segments of 64 on kvledger's VNNI kernel, which also takes decode "
        "batches of 16 and more): faster prefills and large batches; less faithful to the file"
    ), kind="switch")
    """In a quantized mode, run large forwards through an int8 linear (weights int8 per output
    channel; ``kernels/quant.Int8Weight``) instead of the file's blocks: on kvledger's VNNI kernel (a
    CPU with AVX512-VNNI and no AMX) forwards of ``linear.INT8_VNNI_ROWS`` (16) rows and more, decode
    batches included, activations int8 per token and per segment of 64 inputs; elsewhere oneDNN's,
    forwards of ``linear.INT8_BATCH_ROWS`` (128) rows and more (prefill chunks; batched decodes stay on
    kvledger's kernel, the faster one below that), activations int8 per token. Faster prefills and
    large batches, but further from the file's weights (bench/quant_agreement.py), so off by default."""
    cpu_amx: str = setting("auto", (
        "on: quantized layers also keep a prepacked bfloat16 copy for calls of 64 rows and more "
        "(prefill chunks), and long prefills' attention runs in torch's SDPA: oneDNN's AMX kernels (2 "
        "bytes a weight more memory); auto (default): on for a quantized bfloat16 model on a CPU with "
        "AMX"
    ), choices=CPU_AMX)
    """auto | on | off. on: quantized layers keep a oneDNN-prepacked bfloat16 copy of their weights
    (the file's own values, dequantized) and run calls of ``linear.AMX_MIN_ROWS`` rows and more (prefill
    chunks, large batches) through it, and the cpu attention backend runs long extends in torch's
    SDPA, both on the AMX tiles oneDNN and torch use where the CPU has them (3-4x the int4 kernel's
    speed at prefill sizes; bench/RESULTS.md). It costs 2 bytes a weight of memory. auto: on for a
    quantized model in bfloat16 on a CPU with AMX; off: kvledger's kernels for every call."""
    enable_torch_compile: bool = setting(False, "compile the forward with torch.compile (faster decode; compiles at start-up)", kind="switch")
    """Run forwards through torch.compile (weights frozen and prepacked for oneDNN, elementwise work
    fused). Faster batched decode; costs tens of seconds of compilation at start (warm-up)."""
    enable_deterministic_inference: bool = setting(False, (
        "batch invariance: a request's tokens and logprobs are the same whatever its batch, "
        "neighbours, chunk size, prefix-cache state or schedule (every call on kernels whose sums "
        "have one order per row; no AMX paths; unseeded sampling draws from --seed and the position)"
    ), kind="switch")
    """SGLang's flag (vLLM: batch invariance): a request's tokens and logprobs do not depend on the batch
    it runs in, its neighbours, the chunk size, the prefix cache or the schedule. Every call takes the
    kernels whose sums have one order per row (docs/architecture.md, "Reduction orders"): the cpu
    attention backend (long extends in its kernels, not SDPA or the AMX flash form), the quantized
    layers on kvledger's VNNI kernel for every row count (``--cpu-amx auto`` is off under it), float
    layers on its dense kernel, windowed/soft-capped/sink attention and MoE experts one row at a time;
    sampled rows without a seed draw from ``(--seed, position)`` like seeded ones. The default
    already keeps a prompt's tokens the same cached or not on a CPU without AMX (the same kernels)."""
    sampling_backend: str = setting("auto", (
        "host: sample from a CPU copy of the logits; device: batched on the logits' device, one copy "
        "of the sampled ids back (same greedy and seeded tokens); auto (default): device on CUDA, "
        "host on CPU"
    ), choices=SAMPLING_BACKENDS)
    """auto | host | device. host: the sampled rows' logits are copied to the CPU and sampled there
    (model/sampler.py); device: batched torch ops where the logits are, one copy of the sampled ids
    back (model/sampler_device.py); both draw the same greedy and seeded tokens. auto: device on CUDA,
    host on a CPU (where both run on the same cores and the host one is as fast)."""
    disable_cuda_graph: bool = setting(False, (
        "on CUDA, run every step eager (by default a step of decodes alone replays the CUDA graph "
        "captured at start for its batch size)"
    ), kind="switch")
    """SGLang's flag. On CUDA a step of decodes alone replays a CUDA graph captured at start for its
    batch-size bucket (engine/graph_runner.py); with this flag every step runs eager. No meaning on
    a CPU (nothing is captured there)."""
    cuda_graph_max_bs: int | None = setting(None, (
        "the largest decode batch captured in a CUDA graph; larger ones run eager (default 160, "
        "capped at --max-running-requests)"
    ))
    """SGLang's flag: the largest decode batch captured; larger batches run eager. None: SGLang's
    default, 160, capped at ``max_running_requests``."""

    def __post_init__(self) -> None:
        self.attention_backend = _norm(self.attention_backend) or "auto"
        self.cpu_amx = _norm(self.cpu_amx) or "auto"
        self.sampling_backend = _norm(self.sampling_backend) or "auto"

    def check(self) -> None:
        _one_of(self.attention_backend, ATTENTION_BACKENDS, "attention_backend")
        _one_of(self.cpu_amx, CPU_AMX, "cpu_amx")
        _one_of(self.sampling_backend, SAMPLING_BACKENDS, "sampling_backend")
        _positive(self, "cuda_graph_max_bs")


@dataclass
class LoraSettings:
    """LoRA adapters of the base model, served side by side in one batch (``model/lora.py``)."""

    enable_lora: bool = setting(False, "serve LoRA adapters (implied by --lora-paths; needed for /load_lora_adapter)", kind="switch")
    lora_paths: list[str] | None = setting(None, "LoRA adapters (peft directories) loaded at start: name=path, or path (name: its basename)", nargs="+", metavar="NAME=PATH")  # noqa: RUF009 (a declaration, not a call at each construction)
    """Adapters loaded at start: ``name=path`` or ``path`` (the name is then the directory's name);
    each a peft adapter directory (adapter_config.json, adapter_model.safetensors)."""
    max_loras_per_batch: int = setting(8, "most distinct adapters among running requests (the base model takes none)")
    """Most distinct adapters among the running requests (the base model takes none of them): a
    request of another adapter waits until one of those ends."""
    max_lora_rank: int = setting(64, "the largest adapter rank accepted (at start and by /load_lora_adapter)")

    def __post_init__(self) -> None:
        if isinstance(self.lora_paths, str):
            self.lora_paths = [self.lora_paths]
        if self.lora_paths:
            self.lora_paths = list(self.lora_paths)
            self.enable_lora = True

    def named_paths(self) -> dict[str, str]:
        """``--lora-paths`` as name -> path (checked: names unique and non-empty)."""
        out: dict[str, str] = {}
        for item in self.lora_paths or []:
            if not isinstance(item, str) or not item.strip():
                raise ValidationError(f"lora_paths entries are name=path or path, got {item!r}", param="lora_paths")
            name, sep, path = item.partition("=")
            if not sep:
                path, name = item, os.path.basename(os.path.normpath(item))
            if not name or not path:
                raise ValidationError(f"lora_paths entry {item!r} needs a name and a path", param="lora_paths")
            if name in out:
                raise ValidationError(f"lora_paths names {name!r} twice", param="lora_paths")
            out[name] = path
        return out

    def check(self) -> None:
        _positive(self, "max_loras_per_batch", "max_lora_rank")
        # Names unique and non-empty; that each path is a directory is launch/parts.py's
        # check_lora_paths (the disk), run by the composition root after this one.
        self.named_paths()
