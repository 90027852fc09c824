"""Embeddings and scores beside each engine feature (fp32, the tiny Llama): the same values as
transformers whatever the feature — drafts (NGRAM, a STANDALONE draft model: a pooling request never
drafts), the hierarchical cache, the cpu attention backend, mixed chunks, the prefix cache off, a PD
prefill or decode engine (a pooling request is computed where it arrives), tensor parallel (the final
hidden state is whole on rank 0) — with generation running beside them, books clean after."""

from __future__ import annotations

import pytest
import torch

from kvledger import Engine
from tests.engine.test_pooling import close, hf_embedding, prompt
from tests.helpers import assert_idle_clean
from tests.server_harness import free_port

LABELS = [4, 77, 251]


@torch.no_grad()
def check(eng, hf) -> None:
    """A workload of embeddings (both poolings, chunked, a cache hit), a score and generation."""
    gen = eng.add_request(prompt(40, 9), {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0})
    prompts = [prompt(90, 1), prompt(5, 2), prompt(90, 1)[:70]]  # the third a cached prefix of the first
    for pooling in ("last", "mean"):
        for ids, out in zip(prompts, eng.encode(input_ids=prompts, pooling=pooling)):
            assert close(out["embedding"], hf_embedding(hf, ids, pooling)), (pooling, len(ids))
    q, item = prompt(20, 3), prompt(7, 4)
    got = eng.score(query=q, items=[item], label_token_ids=LABELS)[0]
    lp = torch.log_softmax(hf(torch.tensor([q + item])).logits[0, -1].float(), -1)
    assert close(got, lp[LABELS].exp())
    eng.run_until_idle()
    assert eng.result(gen)["meta_info"]["completion_tokens"] == 12
    assert_idle_clean(eng)


@pytest.mark.parametrize(
    "kw",
    [
        dict(speculative_algorithm="NGRAM"),
        dict(enable_hierarchical_cache=True, hicache_ratio=4, max_total_tokens=256),
        dict(attention_backend="cpu"),
        dict(enable_mixed_chunk=True),
        dict(enable_prefix_cache=False),
    ],
    ids=["ngram", "hicache", "cpu_attention", "mixed_chunk", "no_prefix_cache"],
)
def test_pooling_beside_a_feature(make_engine, tiny_llama_hf, kw):
    check(make_engine(**{"chunked_prefill_size": 32, **kw}), tiny_llama_hf)


def test_pooling_beside_a_draft_model(make_engine, tiny_llama_hf, tiny_llama):
    eng = make_engine(
        chunked_prefill_size=32, speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_llama
    )
    check(eng, tiny_llama_hf)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pooling_on_a_pd_engine(make_engine, tiny_llama_hf, mode):
    port = free_port()
    extra = dict(disaggregation_bind_host="127.0.0.1") if mode == "prefill" else {}
    eng = make_engine(
        chunked_prefill_size=32, disaggregation_mode=mode, disaggregation_bootstrap_port=port, **extra
    )
    check(eng, tiny_llama_hf)


def test_pooling_under_tensor_parallel(tiny_llama, tiny_llama_hf):
    eng = Engine(
        model=tiny_llama, tp_size=2, dtype="float32", page_size=16, max_total_tokens=1024,
        chunked_prefill_size=32, strict_memory=True,
    )  # fmt: skip
    try:
        check(eng, tiny_llama_hf)
    finally:
        eng.shutdown()


def test_pooling_under_torch_compile_runs_eager_and_compiles_nothing(make_engine, tiny_llama_hf):
    eng = make_engine(chunked_prefill_size=32, enable_torch_compile=True)
    before = eng.core.view.rank_stats()[0]
    check(eng, tiny_llama_hf)
    after = eng.core.view.rank_stats()[0]
    assert (after["graphs"], after["frames"]) == (before["graphs"], before["frames"])
