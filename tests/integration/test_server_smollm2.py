"""The real server on the default model (no --model flag): what a newcomer gets."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvledger import Engine

pytestmark = pytest.mark.smollm2


def test_openai_chat_paris_streamed_equals_unstreamed(smol_server, smollm2_loaded):
    c = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=32, temperature=0
    )
    text = full.choices[0].message.content
    assert "Paris" in text and full.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=32, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == text
    # Greedy equals the offline Engine on the same weights.
    eng = Engine(loaded_model=smollm2_loaded, dtype="float32", page_size=16, max_total_tokens=4096)
    ids = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert (
        eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 32, "temperature": 0})["text"] == text
    )
    r = httpx.post(
        smol_server.url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0
    smol_server.wait_idle_clean()
