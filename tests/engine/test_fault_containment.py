"""A fault while computing one request ends that request with a 500 through the release path; its
batch neighbours produce exactly what they would have."""

from __future__ import annotations

from kvledger import Engine
from tests.helpers import assert_idle_clean

G = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}


def test_injected_fault_is_contained(tiny_loaded, monkeypatch):
    prompts = [[3 + i] * (10 + 9 * i) for i in range(5)]
    ref = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, strict_memory=True)
    refs = [ref.generate(input_ids=p, sampling_params=G)["output_ids"] for p in prompts]
    monkeypatch.setenv("KVLEDGER_TEST_FAULT_RIDS", "bad")
    eng = Engine(
        loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, strict_memory=True, page_size=16
    )
    rids = [eng.add_request(p, G, rid="bad" if i == 2 else None) for i, p in enumerate(prompts)]
    eng.run_until_idle()
    for i, rid in enumerate(rids):
        res = eng.result(rid)
        if rid == "bad":
            fr = res["meta_info"]["finish_reason"]
            assert fr["type"] == "abort" and "injected fault" in fr["message"]
            assert res["output_ids"] == []
        else:
            assert res["output_ids"] == refs[i]
    assert_idle_clean(eng)
    assert_idle_clean(ref)
