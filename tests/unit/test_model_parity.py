"""The forward pass against transformers on the same weights (fp32): logits and greedy tokens,
whatever the batching, chunking and page size."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import Engine, kernels
from kvledger.memory import KVBuffer
from kvledger.model import ForwardBatch, LlamaModel, load_model
from tests.helpers import assert_idle_clean, hf_greedy, hf_model

GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
LENGTHS = (1, 2, 7, 16, 33, 64, 129, 300)


def _prompts(seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch_model(request, tiny_llama, tiny_qwen3):
    path = tiny_llama if request.param == "llama" else tiny_qwen3
    hf = hf_model(path)
    prompts = _prompts(7)
    refs = [hf_greedy(hf, p, 32) for p in prompts]
    return path, hf, prompts, refs


def _paged_prefill_logits(path: str, prompt: list[int], page_size: int) -> torch.Tensor:
    loaded = load_model(path)
    cfg = loaded.config
    model = LlamaModel(cfg, loaded.weights, dtype=torch.float32)
    n = len(prompt)
    num_pages = -(-n // page_size) + 2
    kv = KVBuffer(cfg.num_layers, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    # Pages in reverse order: the page table, not contiguity, must decide where tokens live.
    pages = list(range(num_pages - 1, -1, -1))[: -(-n // page_size)]
    slots = torch.tensor([p * page_size + o for p in pages for o in range(page_size)])[:n]
    table = torch.zeros(1, num_pages * page_size, dtype=torch.int64)
    table[0, :n] = slots
    batch = ForwardBatch(
        input_ids=torch.tensor(prompt),
        positions=torch.arange(n),
        out_loc=slots,
        req_rows=[0],
        prefix_lens=[0],
        extend_lens=[n],
        seq_lens=[n],
        logit_index=torch.arange(n),
        req_to_token=table,
        page_size=page_size,
    )
    return model.forward(batch, kv)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_logits_match_transformers(arch_model, page_size):
    path, hf, prompts, _ = arch_model
    prompt = prompts[6]  # 129 tokens
    ours = _paged_prefill_logits(path, prompt, page_size)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "opts",
    [
        dict(page_size=16, chunked_prefill_size=4096),  # (a) all at once
        dict(page_size=16, chunked_prefill_size=7, enable_mixed_chunk=True),  # (b) chunks of 7
        dict(page_size=16, chunked_prefill_size=64, enable_mixed_chunk=True),  # (b) chunks of 64
        dict(page_size=1, chunked_prefill_size=512),  # (c) page size 1
        dict(page_size=16, chunked_prefill_size=64, enable_mixed_chunk=False),
    ],
    ids=["all-at-once", "chunk7", "chunk64", "page1", "unmixed"],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_transformers(arch_model, opts, backend):
    """Both attention backends; ``cpu`` also runs the norms, rotary and SiLU in the C++ kernels, which
    in fp32 differ from torch only in the order of sums: the greedy tokens stay exact."""
    path, _, prompts, refs = arch_model
    if backend == "cpu" and not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    eng = Engine(
        path, dtype="float32", max_total_tokens=8192, strict_memory=True, attention_backend=backend, **opts
    )
    assert eng.core.model.attention == backend
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for p, o, ref in zip(prompts, outs, refs):
        assert o["output_ids"] == ref, f"prompt of {len(p)} tokens"
        assert o["meta_info"]["completion_tokens"] == 32
        assert o["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle_clean(eng)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batches_decode_while_others_prefill(arch_model, page_size, backend):
    """(d) Requests arrive while others decode, so prefill chunks and decodes share forwards."""
    path, _, prompts, refs = arch_model
    if backend == "cpu" and not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    eng = Engine(
        path,
        dtype="float32",
        attention_backend=backend,
        page_size=page_size,
        max_total_tokens=8192,
        strict_memory=True,
        chunked_prefill_size=48,
        enable_mixed_chunk=True,
    )
    rids, mixed_steps = [], 0
    for p in prompts:
        rids.append(eng.add_request(p, GREEDY))
        for _ in range(3):
            eng.step()
            s = eng.core.scheduler.last_stats
            mixed_steps += s.num_decode > 0 and s.num_prefill_tokens > 0
    eng.run_until_idle()
    assert mixed_steps >= 3, "the test must exercise mixed prefill+decode forwards"
    for rid, ref in zip(rids, refs):
        assert eng.result(rid)["output_ids"] == ref
    assert_idle_clean(eng)


def test_prefix_cache_hits_keep_output_exact(arch_model):
    path, _, prompts, refs = arch_model
    eng = Engine(path, dtype="float32", page_size=16, max_total_tokens=8192, strict_memory=True)
    first = eng.generate(input_ids=prompts[7], sampling_params=GREEDY)
    again = eng.generate(input_ids=prompts[7], sampling_params=GREEDY)
    assert first["output_ids"] == again["output_ids"] == refs[7]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == (len(prompts[7]) - 1) // 16 * 16
    assert_idle_clean(eng)


def test_two_models_in_one_process(tiny_llama, tiny_qwen3):
    a = Engine(tiny_llama, dtype="float32", max_total_tokens=1024, strict_memory=True)
    b = Engine(tiny_qwen3, dtype="float32", max_total_tokens=1024, strict_memory=True)
    p = [5, 6, 7, 8]
    ra = a.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    rb = b.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    assert ra != rb
    assert a.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] == ra
    assert_idle_clean(a)
    assert_idle_clean(b)


def test_bf16_close_to_fp32(tiny_llama):
    """bf16 is not token-exact; its prefill logits stay within a small, documented distance."""
    prompt = list(range(3, 103))
    eng32 = Engine(tiny_llama, dtype="float32", max_total_tokens=1024)
    eng16 = Engine(tiny_llama, dtype="bfloat16", max_total_tokens=1024)
    p = {"max_new_tokens": 1, "temperature": 0, "top_logprobs": 5, "logprobs": True}
    a = eng32.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0][0]
    b = eng16.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0][0]
    assert abs(a - b) < 0.1
