"""Repeatable answers (issue 56 item 5).

By default, a greedy request gives the same tokens and logprobs whether its prompt was cached or not,
and whatever the chunk size, on the route a CPU without AMX takes (the kernels' one order of sums per
row: csrc/flash.h, docs/architecture.md "Reduction orders"). On a CPU with AMX its large calls take
other sums: these tests turn those paths off there, as such a CPU runs them.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import Engine, kernels
from tests.helpers import assert_idle_clean

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
    from kvledger.server.tools import make_parser, render_messages

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
