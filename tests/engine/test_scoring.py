"""Prompt logprobs (scoring) on the offline engine: equal to a full transformers forward, with and
without a cached prefix, across chunks and pages; max_new_tokens 0 scores without generating."""

from __future__ import annotations

import pytest
import torch

from kvledger import ValidationError

TOL = 1e-4  # fp32


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from one full forward."""
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def _scores(out: dict) -> list[float | None]:
    return [x[0] for x in out["meta_info"]["input_token_logprobs"]]


@pytest.mark.parametrize("page_size, chunk", [(1, 7), (16, 64)])
def test_prompt_logprobs_equal_a_full_forward_with_and_without_a_cached_prefix(
    make_engine, tiny_llama_hf, page_size, chunk
):
    eng = make_engine(page_size=page_size, chunked_prefill_size=chunk)
    ids = [(5 + 7 * i) % 250 + 3 for i in range(90)]
    ref = hf_prompt_logprobs(tiny_llama_hf, ids)
    sp = {"max_new_tokens": 0, "logprob_start_len": 0, "top_logprobs": 3}
    cold = eng.generate(input_ids=ids, sampling_params=sp)
    assert cold["output_ids"] == [] and cold["meta_info"]["finish_reason"]["type"] == "length"
    lps = _scores(cold)
    assert lps[0] is None and len(lps) == len(ids)
    assert torch.allclose(torch.tensor(lps[1:]), ref, atol=TOL)
    # The whole prompt is now cached; asking again must compute the positions asked for, not reuse.
    warm = eng.generate(input_ids=ids, sampling_params=sp)
    assert torch.allclose(torch.tensor(_scores(warm)[1:]), ref, atol=TOL)
    # From a later start, the prefix before it may come from the cache, and only the rest is computed.
    start = 40
    late = eng.generate(
        input_ids=ids, sampling_params={**sp, "logprob_start_len": start, "max_new_tokens": 2}
    )
    assert late["meta_info"]["cached_tokens"] == (start - 1) // page_size * page_size > 0
    assert torch.allclose(torch.tensor(_scores(late)), ref[start - 1 :], atol=TOL)
    assert [x[1] for x in late["meta_info"]["input_token_logprobs"]] == ids[start:]
    # Top logprobs of the prompt: the largest of the full forward's distribution at each position.
    tops = warm["meta_info"]["input_top_logprobs"]
    assert tops[0] is None
    full = torch.log_softmax(tiny_llama_hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = full[5].topk(3)
    assert [t for _, t, _ in tops[6]] == want.indices.tolist()
    assert torch.allclose(torch.tensor([lp for lp, _, _ in tops[6]]), want.values, atol=TOL)


def test_prompt_logprobs_under_retraction_and_batching(make_engine, tiny_llama_hf):
    eng = make_engine(max_total_tokens=256, page_size=16, chunked_prefill_size=32)
    prompts = [[3 + i] * 10 + list(range(20, 50 + 5 * i)) for i in range(6)]
    sp = {"max_new_tokens": 30, "logprob_start_len": 0, "ignore_eos": True, "temperature": 0}
    outs = eng.generate(input_ids=prompts, sampling_params=sp)
    assert eng.core.scheduler.total_retractions > 0
    for ids, out in zip(prompts, outs):
        assert torch.allclose(
            torch.tensor(_scores(out)[1:]), hf_prompt_logprobs(tiny_llama_hf, ids), atol=TOL
        )


def test_scoring_refusals(make_engine):
    eng = make_engine()
    with pytest.raises(ValidationError):
        eng.generate(input_ids=[3, 4], sampling_params={"logprob_start_len": -2})
    sid = eng.open_session()
    with pytest.raises(ValidationError) as e:
        eng.generate(input_ids=[3, 4], sampling_params={"logprob_start_len": 0}, session_params={"id": sid})
    assert e.value.param == "logprob_start_len"
    eng.close_session(sid)
    # max_new_tokens 0 without prompt logprobs: nothing to compute, done at once.
    out = eng.generate(input_ids=[3, 4], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and "input_token_logprobs" not in out["meta_info"]
