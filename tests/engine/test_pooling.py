"""Embeddings and label scores on the offline engine (fp32): equal to transformers' final-norm hidden
states and next-token logprobs on the same weights, across chunks, pages, the prefix cache, batches
and retraction; they draw no token and leave nothing held."""

from __future__ import annotations

import pytest
import torch

from kvledger import ValidationError
from kvledger.common.pooling import PoolingParams

TOL = 1e-5  # fp32


@torch.no_grad()
def hf_embedding(model, ids: list[int], pooling: str) -> torch.Tensor:
    """The reference: the final norm's output (``last_hidden_state``), pooled, L2-normalised."""
    h = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / v.norm()


def prompt(n: int, k: int = 0) -> list[int]:
    return [(5 + 7 * i + 13 * k) % 250 + 3 for i in range(n)]


def close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), want, atol=TOL)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("page_size, chunk", [(1, 7), (16, 32)])
def test_embeddings_equal_transformers_chunked_batched(make_engine, tiny_llama_hf, pooling, page_size, chunk):
    eng = make_engine(page_size=page_size, chunked_prefill_size=chunk)
    prompts = [prompt(90, 0), prompt(1, 1), prompt(17, 2), prompt(40, 3)]  # 90 > chunk: chunked
    outs = eng.encode(input_ids=prompts, pooling=pooling)
    assert len(outs) == len(prompts)
    for ids, out in zip(prompts, outs):
        assert len(out["embedding"]) == 64
        assert close(out["embedding"], hf_embedding(tiny_llama_hf, ids, pooling)), (pooling, len(ids))
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 0
    one = eng.encode(input_ids=prompts[0], pooling=pooling)  # a single prompt gives one result
    assert close(one["embedding"], hf_embedding(tiny_llama_hf, prompts[0], pooling))


def test_embeddings_after_a_prefix_cache_hit(make_engine, tiny_llama_hf):
    """A cached prompt: last pooling uses the cache (only the last position is computed), mean
    pooling computes every position (a cached prefix has no hidden states)."""
    eng = make_engine(page_size=16, chunked_prefill_size=32)
    ids = prompt(70, 5)
    eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})  # 64 tokens of it cached
    last = eng.encode(input_ids=ids, pooling="last")
    assert last["meta_info"]["cached_tokens"] == 64
    assert close(last["embedding"], hf_embedding(tiny_llama_hf, ids, "last"))
    mean = eng.encode(input_ids=ids, pooling="mean")
    assert mean["meta_info"]["cached_tokens"] == 0
    assert close(mean["embedding"], hf_embedding(tiny_llama_hf, ids, "mean"))
    # The embedding requests' KV went to the cache like any finished request's: a longer prompt hits.
    longer = ids + prompt(30, 6)
    out = eng.generate(input_ids=longer, sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["cached_tokens"] == 64


def test_mean_pooling_through_retraction(make_engine, tiny_llama_hf, monkeypatch):
    """A pool too small for everything at once: an embedding request is retracted mid-prompt and
    recomputed (what it summed is kept, the cache serves only that); the mean covers each position once."""
    eng = make_engine(max_total_tokens=256, page_size=16, chunked_prefill_size=32, enable_mixed_chunk=True)
    policy = eng.core.scheduler.policy
    retracted = []
    retract = policy.retract
    monkeypatch.setattr(policy, "retract", lambda r: (retracted.append(r.pooling is not None), retract(r)))
    gens = [eng.add_request(prompt(30, 10 + i), {"max_new_tokens": 60, "ignore_eos": True}) for i in range(3)]
    eng.step()
    eng.step()
    prompts = [prompt(100 + 10 * i, 20 + i) for i in range(3)]
    outs = eng.encode(input_ids=prompts, pooling="mean")
    eng.run_until_idle()
    assert all(eng.result(rid)["meta_info"]["finish_reason"]["type"] == "length" for rid in gens)
    assert any(retracted), "no embedding request was retracted: the test lost its point"
    for ids, out in zip(prompts, outs):
        assert close(out["embedding"], hf_embedding(tiny_llama_hf, ids, "mean"))


@torch.no_grad()
def test_score_is_the_next_token_distribution(make_engine, tiny_llama_hf):
    eng = make_engine(page_size=16, chunked_prefill_size=16)
    query, items, labels = prompt(20, 1), [prompt(3, 2), prompt(30, 3)], [5, 9, 200]
    got = eng.score(query=query, items=items, label_token_ids=labels)
    soft = eng.score(query=query, items=items, label_token_ids=labels, apply_softmax=True)
    first = eng.score(query=query, items=items, label_token_ids=labels, item_first=True)
    for j, item in enumerate(items):
        for ids, g in ((query + item, got[j]), (item + query, first[j])):
            lp = torch.log_softmax(tiny_llama_hf(torch.tensor([ids])).logits[0, -1].float(), -1)
            assert torch.allclose(torch.tensor(g, dtype=torch.float32), lp[labels].exp(), atol=TOL)
        lp = torch.log_softmax(tiny_llama_hf(torch.tensor([query + item])).logits[0, -1].float(), -1)
        assert torch.allclose(torch.tensor(soft[j], dtype=torch.float32), torch.softmax(lp[labels], 0), atol=TOL)
    assert eng.score(query=query, items=[], label_token_ids=labels) == []


def test_pooling_refusals_allocate_nothing(make_engine):
    eng = make_engine(context_length=128)
    before = eng.memory()
    bad = [
        dict(input_ids=[]),
        dict(input_ids=[[3, 4], []]),
        dict(input_ids=[3, 999]),  # outside the vocabulary
        dict(input_ids=prompt(128)),  # the whole context
        dict(input_ids=[3, 4], pooling="max"),
    ]
    for kw in bad:
        with pytest.raises(ValidationError):
            eng.encode(**kw)
    with pytest.raises(ValidationError) as e:
        eng.score(query=[3], items=[[4]], label_token_ids=[256])
    assert e.value.param == "label_token_ids"
    with pytest.raises(ValidationError):
        eng.score(query=[3], items=["a"], label_token_ids=[4])  # ids and text mixed
    with pytest.raises(ValidationError):
        eng.core.make_request([3, 4], None, pooling=PoolingParams(embed="last", label_token_ids=[3]))
    sid = eng.open_session()
    with pytest.raises(ValidationError) as e:
        eng.core.submit(eng.core.make_request([3, 4], None, pooling=PoolingParams(embed="last")), {"id": sid})
    assert e.value.param == "session_params"
    eng.close_session(sid)
    assert eng.core.scheduler.reqs == {}
    after = eng.memory()
    assert after["kv_free"] == before["kv_free"] and after["req_slots_free"] == before["req_slots_free"]


def test_a_fault_beside_pooling_requests_is_contained(tiny_loaded, tiny_llama_hf, monkeypatch):
    """A forward that fails for one request is rerun request by request: the embedding and score
    requests beside it get their answers (the rerun carries them), the faulty one a 500."""
    from kvledger import Engine
    from tests.helpers import assert_idle_clean

    monkeypatch.setenv("KVLEDGER_TEST_FAULT_RIDS", "bad")
    eng = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, strict_memory=True, page_size=16)
    ids, labels = prompt(40, 7), [4, 9]
    emb = eng.add_request(ids, None, pooling=PoolingParams(embed="mean"))
    lab = eng.add_request(ids, None, pooling=PoolingParams(label_token_ids=labels))
    bad = eng.add_request(prompt(20, 8), {"max_new_tokens": 4}, rid="bad")
    eng.run_until_idle()
    assert "injected fault" in eng.result(bad)["meta_info"]["finish_reason"]["message"]
    assert close(eng.result(emb)["embedding"], hf_embedding(tiny_llama_hf, ids, "mean"))
    with torch.no_grad():
        lp = torch.log_softmax(tiny_llama_hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    assert close(eng.result(lab)["label_logprobs"], lp[labels])
    assert_idle_clean(eng)
    eng.shutdown()
