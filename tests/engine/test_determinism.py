"""Repeatable answers (issue 56 item 5).

By default, a greedy request gives the same tokens and logprobs whether its prompt was cached or not,
and whatever the chunk size, on the route a CPU without AMX takes (the kernels' one order of sums per
row: csrc/flash.h, docs/architecture.md "Reduction orders"). On a CPU with AMX its large calls take
other sums: these tests turn those paths off there, as such a CPU runs them.

``--enable-deterministic-inference``: tokens AND logprobs of one request alone equal those of the same
request among 1..32 random neighbours arriving at random steps, chunked (several chunk sizes), cached
and not, overlap on and off, mixed chunks, pages of 1 and 16, greedy and sampled (seeded or not), on
every route (quantized and float weights, the bf16 flash form and the float kernels), compared with
``==``. SmolLM2 (the model where the defect showed) for a few cases, tiny models for breadth. Every
engine is audited clean at teardown."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import Engine, kernels
from kvledger.errors import ValidationError
from tests.helpers import assert_idle_clean, build_tiny_model

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")

GREEDY = {"temperature": 0, "ignore_eos": True, "logprobs": True}


@pytest.fixture
def engines():
    """Engines built here are audited clean at teardown; on a CPU with AMX the flash kernel's AMX form
    is off meanwhile (the default route of a CPU without it: a process-wide switch of the kernels)."""
    made = []
    was = torch.ops.kvledger_cpu.set_flash_amx(False) if kernels.load() else True

    def make(loaded, **kw):
        eng = Engine(loaded_model=loaded, strict_memory=True, **kw)
        made.append(eng)
        return eng

    yield make
    try:
        for eng in made:
            assert_idle_clean(eng)
    finally:
        for eng in made:
            eng.shutdown()
        torch.ops.kvledger_cpu.set_flash_amx(was)


def _answer(r: dict) -> tuple[list[int], list[float]]:
    return r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]


def run_among(eng: Engine, prompt: list[int], sp: dict, rng: random.Random, neighbours: int, vocab: int,
              longest: int) -> tuple[list[int], list[float]]:  # fmt: skip
    """``prompt``'s answer when ``neighbours`` random prompts (1..``longest`` tokens, 1..12 new tokens,
    greedy or sampled) arrive at random steps around it (it arrives at step 0..3)."""
    plan = [(rng.randrange(0, 4), prompt, sp)]
    for _ in range(neighbours):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, longest + 1))]
        nsp = {"max_new_tokens": rng.randrange(1, 13), "ignore_eos": True,
               "temperature": rng.choice([0, 0.7]), "logprobs": rng.random() < 0.5}  # fmt: skip
        plan.append((rng.randrange(0, 10), ids, nsp))
    target = None
    step = 0
    while True:
        for at, ids, p in plan:
            if at == step:
                rid = eng.add_request(ids, p)
                target = rid if ids is prompt else target
        if step >= 10 and eng.core.scheduler.idle:
            break
        eng.step()
        step += 1
    out = eng.result(target)
    return _answer(out)


# -- SmolLM2, the default model --------------------------------------------------------------------------
def _tool_prompt(tokenizer) -> list[int]:
    """Issue 56's request: the weather in Paris and 2 + 3, with a get_weather and an add tool (the
    hermes parser's system prompt, as the server renders it for SmolLM2's template)."""
    from kvledger.server.tool_requests import render_messages
    from kvledger.server.tools import make_parser

    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"]}}},
    ]  # fmt: skip
    msgs = render_messages([{"role": "user", "content": "What's the weather in Paris? And what is 2 + 3?"}],
                           tools, make_parser("hermes"), False)  # fmt: skip
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))


def test_a_greedy_request_answers_the_same_cached_or_not_by_default(smollm2_loaded, engines):
    """Issue 56: the tool prompt cold (one extend: the flash kernel), as a prefix-cache hit (its
    uncached tail recomputed: an 11-token extend with pages of 16), after flush_cache; on an engine
    with pages of 1, chunks of 64 and overlap, cold (chunked), as a hit (a one-token decode) and among
    random neighbours: the same tokens and logprobs. (Before: the cold prefill's rows went through the flash kernel, the
    hit's through the per-token or the decode kernel, which summed otherwise: the first token's
    logprob 0.009-0.02 off, the tokens apart from the 6th on.)"""
    prompt = _tool_prompt(smollm2_loaded.tokenizer)
    sp = {**GREEDY, "max_new_tokens": 12}
    eng = engines(smollm2_loaded, cpu_amx="off", page_size=16)
    cold = eng.generate(input_ids=prompt, sampling_params=sp)
    hit = eng.generate(input_ids=prompt, sampling_params=sp)
    assert hit["meta_info"]["cached_tokens"] > 0
    assert _answer(hit) == _answer(cold)
    eng.flush_cache()
    assert _answer(eng.generate(input_ids=prompt, sampling_params=sp)) == _answer(cold)
    one = engines(smollm2_loaded, cpu_amx="off", page_size=1, chunked_prefill_size=64, disable_overlap_schedule=False)
    assert _answer(one.generate(input_ids=prompt, sampling_params=sp)) == _answer(cold)
    hit = one.generate(input_ids=prompt, sampling_params=sp)
    assert hit["meta_info"]["cached_tokens"] == len(prompt) - 1 and _answer(hit) == _answer(cold)
    one.flush_cache()  # and among 8 random neighbours (greedy and sampled) arriving at random steps
    assert run_among(one, prompt, sp, random.Random(5), 8, 20000, 40) == _answer(cold)


def test_deterministic_inference_on_smollm2(smollm2_loaded, engines):
    """The flag on the default model and precision (Q4_1 blocks on the int4 kernel, bf16; on a CPU with
    AMX too): the tool prompt alone, as a cache hit, and among random neighbours on an engine with
    chunks of 48 and overlap, greedy and sampled without a seed: the same tokens and logprobs."""
    prompt = _tool_prompt(smollm2_loaded.tokenizer)
    rng = random.Random(56)
    sps = [{**GREEDY, "max_new_tokens": 8}, {"temperature": 0.8, "max_new_tokens": 8, "logprobs": True}]
    eng = engines(smollm2_loaded, enable_deterministic_inference=True)
    assert eng.core.model.attention == "cpu" and not eng.core.model.amx
    alone = [_answer(eng.generate(input_ids=prompt, sampling_params=sp)) for sp in sps]
    assert [_answer(eng.generate(input_ids=prompt, sampling_params=sp)) for sp in sps] == alone  # cached
    busy = engines(smollm2_loaded, enable_deterministic_inference=True, chunked_prefill_size=48,
                   disable_overlap_schedule=False)  # fmt: skip
    for sp, want in zip(sps, alone):
        assert run_among(busy, prompt, sp, rng, 6, 20000, 60) == want


# -- tiny models: every route ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Llama with head_dim 64 (the bf16 flash form where the CPU has AVX512-BF16) and the
    session's tiny Llama (head_dim 16: the float kernels)."""
    from kvledger.model import load_model

    hd64 = build_tiny_model(str(tmp_path_factory.mktemp("det_hd64")), "llama", seed=7, hidden_size=96,
                            num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                            max_position_embeddings=2048)  # fmt: skip
    hd16 = build_tiny_model(str(tmp_path_factory.mktemp("det_hd16")), "llama", seed=8)
    return {"hd64": load_model(hd64), "hd16": load_model(hd16)}


# (model, settings): quantized and float weights, bf16 and float32, the two attention forms
ROUTES = [
    ("hd64", {"dtype": "bfloat16", "quantization": "int4"}),
    ("hd64", {"dtype": "bfloat16"}),  # a float checkpoint: the dense kernel
    ("hd16", {"dtype": "bfloat16", "quantization": "int8"}),
    ("hd16", {"dtype": "float32"}),
]


@pytest.mark.parametrize(("model", "route"), ROUTES, ids=["hd64-int4", "hd64-bf16", "hd16-int8", "hd16-fp32"])
def test_deterministic_inference_gives_one_answer_whatever_the_batch(tiny_models, engines, model, route):
    """One prompt (150 tokens) alone, then as a cache hit, then among 1..32 random neighbours arriving at
    random steps, on engines that chunk it (16, 37, 64 tokens), with overlap, mixed chunks, pages of 1:
    greedy and sampled without a seed (drawn from the engine's seed and the position), every answer
    == the first."""
    loaded = tiny_models[model]
    rng = random.Random(f"{model}{sorted(route.items())}")
    prompt = [rng.randrange(3, 250) for _ in range(150)]
    sps = [{**GREEDY, "max_new_tokens": 10}, {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 10, "logprobs": True}]
    base = dict(enable_deterministic_inference=True, max_total_tokens=16384, max_running_requests=40, **route)
    ref = engines(loaded, **base)
    want = [_answer(ref.generate(input_ids=prompt, sampling_params=sp)) for sp in sps]
    assert [_answer(ref.generate(input_ids=prompt, sampling_params=sp)) for sp in sps] == want  # cached
    variants = [
        {"chunked_prefill_size": 16, "page_size": 1},
        {"chunked_prefill_size": 37, "disable_overlap_schedule": False},
        {"chunked_prefill_size": 64, "enable_mixed_chunk": True, "interleave_prefill_tokens": 0},
    ]
    for i, v in enumerate(variants):
        eng = engines(loaded, **base, **v)
        for n in (1, 32) if i == 0 else (rng.randrange(2, 32),):
            for sp, w in zip(sps, want):
                assert run_among(eng, prompt, sp, rng, n, 250, 200) == w, (v, n, sp)


def test_the_flag_refuses_what_cannot_be_made_batch_invariant(tiny_models):
    """compat.py's rows: int8 batches (their arithmetic changes with the row count), --cpu-amx on, the
    torch attention backend, torch.compile: refused at start, before anything is built."""
    for bad in ({"enable_int8_batch": True, "quantization": "int4"}, {"cpu_amx": "on", "quantization": "int4"},
                {"attention_backend": "torch"}, {"enable_torch_compile": True}):  # fmt: skip
        with pytest.raises(ValidationError, match="deterministic inference"):
            Engine(loaded_model=tiny_models["hd16"], dtype="bfloat16", enable_deterministic_inference=True, **bad)
