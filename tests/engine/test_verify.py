"""The real model runner verifying drafts: one forward feeds each request's drafts as a short
extend beside other requests' plain decodes, and greedy output is token for token what plain
decoding gives (fp32), whatever was accepted or rejected."""

from __future__ import annotations

import pytest

from tests.helpers import assert_idle_clean

G = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}


class OracleProposer:
    """Proposes the reference continuation, with every ``every``-th draft wrong."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int, every: int):
        self.refs, self.k, self.every = refs, k, every
        self.calls = 0

    def propose(self, req) -> list[int]:
        ref = self.refs[tuple(req.input_ids)]
        n = len(req.output_ids)
        drafts = ref[n : n + self.k]
        self.calls += 1
        return [(t + 1) % 256 if (self.calls + j) % self.every == 0 else t for j, t in enumerate(drafts)]


@pytest.mark.parametrize("page_size,every", [(1, 3), (16, 4), (16, 1000)])
def test_verified_greedy_output_equals_plain_decoding(make_engine, page_size, every):
    prompts = [[3 + i] * (4 + 13 * i) for i in range(4)]
    plain = make_engine(page_size=page_size)
    refs = {
        tuple(p): o["output_ids"]
        for p, o in zip(prompts, plain.generate(input_ids=prompts, sampling_params=G))
    }
    eng = make_engine(page_size=page_size, chunked_prefill_size=32)
    eng.core.scheduler.proposer = OracleProposer(refs, k=4, every=every)
    outs = eng.generate(input_ids=prompts, sampling_params=G)
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == refs[tuple(p)]
    assert eng.core.scheduler.proposer.calls > 0
    assert_idle_clean(eng)


def test_verify_logprobs_are_the_targets(make_engine):
    """Logprobs reported for accepted drafts are those plain decoding reports."""
    p = {**G, "max_new_tokens": 12, "logprobs": True}
    prompt = [9, 8, 7, 6, 5]
    plain = make_engine().generate(input_ids=prompt, sampling_params=p)
    eng = make_engine()
    eng.core.scheduler.proposer = OracleProposer({tuple(prompt): plain["output_ids"]}, k=3, every=1000)
    out = eng.generate(input_ids=prompt, sampling_params=p)
    assert out["output_ids"] == plain["output_ids"]
    for (a, ta, _), (b, tb, _) in zip(
        out["meta_info"]["output_token_logprobs"], plain["meta_info"]["output_token_logprobs"]
    ):
        assert ta == tb and abs(a - b) < 1e-4
