"""SmolLM2-135M-Instruct from the shipped GGUF: greedy output equals transformers' on the same GGUF."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvledger import Engine
from tests.helpers import assert_idle_clean

pytestmark = pytest.mark.smollm2

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a KV cache is.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def smol_engine(smollm2_loaded):
    eng = Engine(
        loaded_model=smollm2_loaded,
        dtype="float32",
        page_size=16,
        max_total_tokens=8192,
        chunked_prefill_size=32,
        strict_memory=True,
    )
    yield eng
    assert_idle_clean(eng)


def _chat_ids(tok, question: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )


def test_greedy_matches_transformers_on_the_gguf(smol_engine, smollm2_hf):
    tok = smol_engine.tokenizer
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    outs = smol_engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 32, "temperature": 0})
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = smollm2_hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
            )[0, len(p) :].tolist()
        # transformers stops at EOS too; compare up to and including it.
        assert o["output_ids"] == ref[: len(o["output_ids"])] and len(o["output_ids"]) == len(ref)


def test_capital_of_france_is_paris(smol_engine):
    tok = smol_engine.tokenizer
    out = smol_engine.generate(
        input_ids=_chat_ids(tok, QUESTIONS[0]), sampling_params={"max_new_tokens": 24, "temperature": 0}
    )
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "<|im_end|>" not in out["text"]


def test_text_prompt_and_stop_string(smol_engine):
    tok = smol_engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 10."}], add_generation_prompt=True, tokenize=False
    )
    full = smol_engine.generate(text, {"max_new_tokens": 40, "temperature": 0})
    assert "5" in full["text"]
    cut = smol_engine.generate(text, {"max_new_tokens": 40, "temperature": 0, "stop": ["5"]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": "5"}
    assert cut["text"] == full["text"][: full["text"].index("5")]
    chunks = list(smol_engine.generate(text, {"max_new_tokens": 40, "temperature": 0}, stream=True))
    assert chunks[-1]["text"] == full["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(chunks))
