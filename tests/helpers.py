"""Shared test utilities: tiny random models built with transformers, and reference generation."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from kvledger.scheduler.pacing import StepCosts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# The tiny random models' shapes (every family's test config starts from these).
TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_model(path: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Save a tiny random ``arch`` model (llama | qwen2 | qwen3 | mistral) to ``path``; returns path."""
    import transformers

    base = {**TINY_CONFIG, **overrides}
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    cfg = cls[0](**base)
    model = cls[1](cfg).float().eval()
    # Random init gives tiny weights and near-uniform logits; scale up so greedy choices are clear.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(2.5)
    model.save_pretrained(path)
    return path


def hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation of one unpadded prompt with transformers (the reference)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def assert_idle_clean(engine) -> None:
    """The ledger check every request-running test ends with: audit clean, every slot free, and
    every page free or cached (no private or session pages once idle)."""
    engine.run_until_idle()
    report = engine.audit()
    assert report.ok, report.describe()
    m = engine.memory()
    assert m["req_slots_free"] == m["req_slots_total"], m
    assert m["kv_private"] == 0 and m["kv_cached_protected"] == 0, m
    # Reserved: pages a component keeps for the engine's life (CUDA graphs' padding page), exactly those.
    reserved = engine.core.kv_manager.reserved_pages * m["page_size"]
    assert m.get("kv_reserved", 0) == reserved, m
    assert m["kv_free"] + m["kv_cached_evictable"] + m["kv_session"] + reserved == m["kv_total"], m
    held = sum(s["held_tokens"] for s in engine.sessions())
    assert m["kv_session"] == held, (m, engine.sessions())
    assert all(s["busy_rid"] is None for s in engine.sessions())
    assert m["leak_check"]["ok"], m
    if "hisparse" in m:  # HiSparse: no host or hot page held, the worker's slot states all dropped
        assert m["hisparse"]["host_held"] == 0 and m["kv_hisparse_hot"] == 0, m
        assert not engine.core.runner.sparse.slots, engine.core.runner.sparse.slots


def step_until(eng, cond, limit: int = 500) -> None:
    """Step ``eng`` until ``cond()`` holds (checked before each step), at most ``limit`` steps."""
    for _ in range(limit):
        if cond():
            return
        eng.step()
    raise AssertionError(f"condition not reached in {limit} steps")


def record_drafts(eng) -> list[list[int]]:
    """Every draft ``eng``'s proposer makes from now on, in order (wraps ``propose``)."""
    proposer = eng.core.scheduler.proposer
    seen: list[list[int]] = []
    orig = proposer.propose

    def propose(req, k):
        drafts = orig(req, k)
        seen.append(drafts)
        return drafts

    proposer.propose = propose
    return seen


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_level_tokenizer(template: str | None, extra_specials: tuple[str, ...] = ()):
    """A fast byte-level tokenizer (the 256 bytes, then ``<s>``, ``</s>``, ``<|user|>``, ``<|assistant|>``
    and ``extra_specials``) with ``template``; returns it and its vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_vocab))}
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", *extra_specials]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=template)
    return fast, vocab


def build_tiny_chat_model(
    path: str, seed: int = 5, template: str | None = TINY_CHAT_TEMPLATE, extra_specials: tuple[str, ...] = ()
) -> str:
    """A tiny random Llama with a real byte-level tokenizer and a chat template (vocab 260, plus
    ``extra_specials``); ``template=None``: a model that carries no template (``--chat-template``'s case)."""
    fast, vocab = byte_level_tokenizer(template, extra_specials)
    build_tiny_model(
        path, "llama", seed=seed, vocab_size=len(vocab), bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"]
    )
    fast.save_pretrained(path)
    return path


# A chat template in Qwen3's manner: thinking unless ``enable_thinking`` is false, when the template
# writes an empty reasoning block itself (the model then answers at once).
QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + (m['content'] or '') + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's manner: the template opens the reasoning, so the output begins inside it.
DEEPSEEK_R1_STYLE_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + (m['content'] or '') + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|><think>' }}{% endif %}"
)
# What the scripted reasoning model writes next after each token (greedy): after the generation
# prompt ``<think>Why</think>OK``; after an empty reasoning block (``\n``) just ``OK``; then EOS.
REASONING_SCRIPT = {
    "<|assistant|>": "<think>", "<think>": "W", "W": "h", "h": "y", "y": "</think>",
    "</think>": "O", "\n": "O", "O": "K", "K": "</s>",
}  # fmt: skip


def build_reasoning_chat_model(path: str, template: str = QWEN3_STYLE_TEMPLATE) -> str:
    """A tiny Llama whose greedy output is scripted (``REASONING_SCRIPT``), with a byte-level tokenizer
    where ``<think>`` and ``</think>`` are added tokens that are not special (as in Qwen3 and
    DeepSeek-R1: they survive skip_special_tokens). Its layers add nothing to the residual stream
    (zero output projections), so the next token depends on the last one alone: the embedding gives
    each scripted token a direction of its own, and the LM head maps it to its successor (logit 8;
    every other token 0, so under a grammar the lowest allowed id wins)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_vocab))}
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
    markers = ["<think>", "</think>"]
    for s in specials + markers:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=template)

    def tid(text: str) -> int:
        [i] = fast.encode(text, add_special_tokens=False)
        return i

    build_tiny_model(
        path, "llama", num_hidden_layers=1, vocab_size=len(vocab), bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
    )  # fmt: skip
    import safetensors.torch

    weights = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")) or name in ("model.embed_tokens.weight", "lm_head.weight"):
            w.zero_()
        elif "norm" in name:
            w.fill_(1.0)
    direction: dict[str, int] = {}  # one per successor: tokens that lead to the same one share it
    for src, nxt in REASONING_SCRIPT.items():
        k = direction.setdefault(nxt, len(direction))
        weights["model.embed_tokens.weight"][tid(src), k] = 1.0
        weights["lm_head.weight"][tid(nxt), k] = 1.0
    safetensors.torch.save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    fast.save_pretrained(path)
    return path


def build_lora_adapter(base: str, path: str, seed: int, r: int = 4, targets=("q_proj", "v_proj"),
                       alpha: int = 8, rslora: bool = False) -> str:  # fmt: skip
    """A random peft LoRA adapter of the model at ``base`` saved to ``path`` (adapter_config.json,
    adapter_model.safetensors). peft starts ``B`` at zero (no change); both matrices are drawn here,
    large enough that greedy choices move."""
    from peft import LoraConfig, get_peft_model

    model = hf_model(base)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     use_rslora=rslora, init_lora_weights=False)  # fmt: skip
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    peft_model.save_pretrained(path)
    return path


def peft_merged(base: str, adapter: str):
    """transformers + peft: ``adapter`` merged into the model at ``base`` (the reference)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base), adapter).merge_and_unload().eval()


MIXED_LAYER_REQS = [(0, 300, 1), (1, 40, 1), (2, 200, 5), (3, 0, 150), (4, 170, 90), (5, 0, 7)]
"""(slot, prefix, new tokens) of ``mixed_layer_batch``: decodes, short extends after a prefix, long
extends with and without one."""


def mixed_layer_batch(page_size: int, reqs=MIXED_LAYER_REQS):
    """One forward's batch of ``reqs`` over a page table whose pages lie out of order, as a runner
    builds it (no model): ``(batch, pool_tokens)``, the pool large enough for every page."""
    from kvledger.engine.page_table import PageTable
    from kvledger.engine.runner import ModelRunner
    from kvledger.memory import PageWrite
    from kvledger.scheduler.output import ScheduledReq, SchedulerOutput

    table = PageTable(len(reqs), 512, page_size)
    writes, nxt = [], 3
    for slot, pre, n in reqs:
        np_ = -(-(pre + n) // page_size)
        writes.append(PageWrite(slot, 0, list(range(nxt + np_ - 1, nxt - 1, -1))))  # pages out of order
        nxt += np_
    table.apply(writes)
    sched = SchedulerOutput([ScheduledReq(str(s), s, pre, [5] * n) for s, pre, n in reqs])
    runner = ModelRunner.__new__(ModelRunner)
    runner.page_table, runner.sparse, runner.images = table, None, None
    return runner.build(sched), nxt * page_size


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py imported as the module ``bench_<name>`` (registered in ``sys.modules`` first:
    dataclasses look their module up while the class is built)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def build_tiny_llava(
    path: str, seed: int = 3, image_size: int = 42, patch: int = 7, text: dict | None = None, vision: dict | None = None
) -> str:
    """A tiny random LLaVA (CLIP vision tower, projector, Llama decoder) with a byte-level tokenizer
    holding an ``<image>`` token and LLaVA's processor (CLIP's PIL image processor): an image is
    ``(image_size / patch)**2`` placeholder tokens (36 by default). ``text`` / ``vision``: config
    fields over the tiny ones (bench/vision.py's bigger model)."""
    import transformers

    fast, vocab = byte_level_tokenizer(TINY_CHAT_TEMPLATE, ("<image>",))
    fast.image_token = "<image>"
    text_cfg = transformers.LlamaConfig(**{
        **TINY_CONFIG, "vocab_size": len(vocab), "bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"],
        **(text or {}),
    })  # fmt: skip
    vision_cfg = transformers.CLIPVisionConfig(**{
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "image_size": image_size, "patch_size": patch, "projection_dim": 32, **(vision or {}),
    })  # fmt: skip
    cfg = transformers.LlavaConfig(vision_config=vision_cfg, text_config=text_cfg, image_token_id=vocab["<image>"])
    save_scaled(transformers.LlavaForConditionalGeneration, cfg, seed, path)
    image_proc = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    proc = transformers.LlavaProcessor(
        image_processor=image_proc, tokenizer=fast, patch_size=patch, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1, chat_template=TINY_CHAT_TEMPLATE,
    )  # fmt: skip
    proc.save_pretrained(path)
    return path


def save_scaled(model_cls, cfg, seed: int, path: str) -> None:
    """A random ``model_cls(cfg)`` (seeded), its weights but the norms' scaled 2.5x so that a tiny
    model's logits are far apart (greedy choices not decided by float noise), saved at ``path``."""
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(2.5)
    model.save_pretrained(path)


QWEN_VL_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def build_tiny_qwen2_vl(path: str, seed: int = 3, family: str = "qwen2_vl", patch: int = 4) -> str:
    """A tiny random Qwen2-VL (``family="qwen2_5_vl"``: Qwen2.5-VL) with a byte-level tokenizer holding
    Qwen's vision tokens and the family's processor (``Qwen2VLImageProcessorPil``, no torchvision):
    dynamic resolution, an image of ``h x w`` pixels is ``(h/patch/2) x (w/patch/2)`` placeholder
    tokens after the 2x2 merge (``smart_resize`` rounds the sides to ``2 * patch``). The decoder's
    M-RoPE sections ``[2, 3, 3]`` split its 8 rotary frequencies over (temporal, height, width)."""
    import transformers

    fast, vocab = byte_level_tokenizer(TINY_CHAT_TEMPLATE, QWEN_VL_SPECIALS)
    fast.image_token, fast.video_token = "<|image_pad|>", "<|video_pad|>"
    text = dict(TINY_CONFIG, vocab_size=len(vocab), bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"])
    # rope_theta 10: each section's frequencies turn far enough over an image's few rows and columns
    # that a token at a wrong (temporal, height, width) position changes the logits well past float noise.
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [2, 3, 3]}
    vision = dict(depth=2, embed_dim=32, hidden_size=TINY_CONFIG["hidden_size"], num_heads=4, patch_size=patch,
                  spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    if family == "qwen2_5_vl":
        vision.update(intermediate_size=64, out_hidden_size=TINY_CONFIG["hidden_size"], window_size=4 * patch,
                      fullatt_block_indexes=[1])  # fmt: skip
        vision.pop("embed_dim")
        vision["hidden_size"] = 32
        cfg_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        cfg_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    cfg = cfg_cls(
        text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )  # fmt: skip
    save_scaled(model_cls, cfg, seed, path)
    image_proc = transformers.Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=(4 * patch) ** 2, max_pixels=(24 * patch) ** 2
    )
    # (The family's ``Qwen2VLProcessor`` needs a video processor, which needs torchvision: the
    # image processor and the tokenizer are saved alone, as the engine reads them.)
    image_proc.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def tiny_image(seed: int, size: tuple[int, int] = (50, 40)):
    """A random RGB ``PIL.Image`` (``size``: width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


class FixedCosts(StepCosts):
    """Step costs as given, not measured (``--mixed-step-ratio``'s budgets then do not depend on the
    machine's timings): each of ``decode``, ``prefill``, ``mixed`` a fit ``(w, c)`` in seconds."""

    def __init__(self, decode, prefill, mixed):
        super().__init__()
        self.decode.fit, self.prefill.fit, self.mixed.fit = decode, prefill, mixed

    def observe(self, decode_rows, prefill_rows, seconds):
        pass
