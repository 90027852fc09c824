"""The one-call decode (``models/one_call.py``, csrc/decode_step.cpp) on each family that describes
its layers: tiny random models built here, against the Python per-layer loop of the same engine and
against transformers. In float32 under deterministic inference the call runs the dense kernel, as the
loop's layers do: greedy tokens equal to transformers', logprobs within a tight bound of the loop's;
in bf16 with int4 projections (the serving path) close to the loop (Gemma's loop runs torch's norms
and rotary, which round otherwise in bf16). Llama's layers take the same ops as its fused loop, bit for
bit: tests/engine/test_cpu_backend.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvledger import Engine, kernels
from kvledger.model import causal_lm
from tests.helpers import assert_idle_clean, build_tiny_model, hf_greedy
from tests.unit.test_families import build_family

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")

GREEDY = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True, "logprobs": True}
# family -> settings over test_families' (Gemma 2 without its attention soft-cap: the call has none)
CASES = {
    "gemma3": {},
    "gemma2": {},  # its attention soft-cap taken out of the saved config (_build)
    "mistral_window": {},
    "olmo2": {},
    "qwen3": None,
}


def _build(path: str, family: str) -> str:
    if family == "qwen3":  # Llama's layer with per-head q/k norms: test_model_parity's tiny config
        return build_tiny_model(path, "qwen3", pad_token_id=0)
    build_family(path, family, **CASES[family])
    if family == "gemma2":  # (build_family drops None settings: transformers' default cap would stand)
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg["attn_logit_softcapping"] = None
        (Path(path) / "config.json").write_text(json.dumps(cfg))
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (2, 9, 30)]  # windows of 8: some cut


def _run(path: str, one_call: bool, monkeypatch, **kw) -> tuple[list, int, object]:
    monkeypatch.setattr(causal_lm, "DECODE_IN_ONE_CALL", one_call)
    eng = Engine(path, page_size=4, max_total_tokens=2048, strict_memory=True, attention_backend="cpu", **kw)
    outs = eng.generate(input_ids=_prompts(), sampling_params=GREEDY)
    one = eng.generate(input_ids=_prompts()[1], sampling_params=GREEDY)  # a single stream
    model = eng.core.model
    assert_idle_clean(eng)
    eng.shutdown()
    return [*outs, one], model.one_call_forwards, model.net.decode_plan


@pytest.mark.parametrize("family", sorted(CASES))
def test_one_call_decode_in_float32_equals_transformers_and_the_loop(family, tmp_path, monkeypatch):
    import transformers

    path = _build(str(tmp_path), family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    refs = [hf_greedy(hf.eval(), p, GREEDY["max_new_tokens"]) for p in _prompts()]
    kw = dict(dtype="float32", enable_deterministic_inference=True)
    loop, n_loop, _ = _run(path, False, monkeypatch, **kw)
    fused, n_fused, plan = _run(path, True, monkeypatch, **kw)
    assert plan is not None and n_loop == 0 and n_fused > 0
    for o, ref in zip(fused, [*refs, refs[1]]):
        assert o["output_ids"] == ref
    for a, b in zip(loop, fused):
        assert a["output_ids"] == b["output_ids"]
        lp_a = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
        lp_b = [t[0] for t in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4


@pytest.mark.parametrize("family", ["gemma3", "olmo2", "qwen3"])
def test_one_call_decode_in_bf16_int4_takes_the_loops_tokens(family, tmp_path, monkeypatch):
    """The serving path: bf16 activations, the kernel's int4 projections."""
    path = _build(str(tmp_path), family)
    kw = dict(dtype="bfloat16", quantization="int4")
    loop, n_loop, _ = _run(path, False, monkeypatch, **kw)
    fused, n_fused, plan = _run(path, True, monkeypatch, **kw)
    assert plan is not None and n_loop == 0 and n_fused > 0
    # bf16 rounds the loop's torch norms and rotary otherwise than the call's loops: a near tie of this
    # random model may go the other way late in an answer; the heads of the answers agree, and the
    # logprobs of the tokens both chose within bf16's error
    for a, b in zip(loop, fused):
        assert a["output_ids"][:6] == b["output_ids"][:6]
        same = next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), None)
        lp_a = [t[0] for t in a["meta_info"]["output_token_logprobs"][:same]]
        lp_b = [t[0] for t in b["meta_info"]["output_token_logprobs"][:same]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 0.1


def test_attention_soft_cap_keeps_the_loop(tmp_path):
    """Gemma 2's attention soft-cap is not in the call: no plan, the Python loop serves."""
    eng = Engine(build_family(str(tmp_path), "gemma2"), dtype="bfloat16", quantization="int4",
                 attention_backend="cpu", max_total_tokens=1024)  # fmt: skip
    assert eng.core.model.net.decode_plan is None
    eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 3})
    assert eng.core.model.one_call_forwards == 0
    eng.shutdown()


def test_greedy_rows_take_the_head_argmax_in_cpp(tmp_path, monkeypatch):
    """Greedy requests without logprobs get their tokens from ``LMHead.greedy`` (the tied, packed head
    in C++, no logits), in the one-call decode and in prefill steps alike: the same tokens as the
    logits path (the runner's check turned off)."""
    from kvledger.engine import runner as runner_mod

    path = build_family(str(tmp_path), "gemma3")  # tied embeddings
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(runner_mod.ModelRunner, "_greedy_only", lambda self, sched, batch: False)
        eng = Engine(
            path, dtype="bfloat16", quantization="int8", attention_backend="cpu", max_total_tokens=1024
        )
        model = eng.core.model
        calls = []
        real = model.net.lm_head.greedy
        monkeypatch.setattr(
            model.net.lm_head, "greedy", lambda h, calls=calls, real=real: calls.append(h.shape[0]) or real(h)
        )
        runs.append([o["output_ids"] for o in eng.generate(input_ids=_prompts(), sampling_params=sp)])
        assert bool(calls) == fused and (model.one_call_forwards > 0)
        # a request that asks for logprobs takes the logits path
        n = len(calls)
        eng.generate(input_ids=_prompts()[0], sampling_params={**sp, "logprobs": True})
        assert len(calls) == n
        eng.shutdown()
    assert runs[0] == runs[1]
