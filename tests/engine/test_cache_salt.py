"""``cache_salt``: requests with different salts never share prefix-cache KV, the same salt does, and
the output is the same as without a cache. Strict engines, audited clean at teardown (``make_engine``)."""

from __future__ import annotations

import pytest

G = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
PROMPT = list(range(3, 103))


def _run(eng, salt=None) -> dict:
    sp = {**G, "cache_salt": salt} if salt is not None else G
    return eng.generate(input_ids=PROMPT, sampling_params=sp)


@pytest.mark.parametrize("page_size", [1, 16])
def test_salts_isolate_the_prefix_cache(make_engine, page_size):
    eng = make_engine(page_size=page_size)
    want = make_engine(page_size=page_size, enable_prefix_cache=False).generate(input_ids=PROMPT, sampling_params=G)
    full = (len(PROMPT) - 1) // page_size * page_size  # a match covers at most all but the last token
    a = _run(eng, "tenant-a")
    assert a["meta_info"]["cached_tokens"] == 0
    for salt in ("tenant-b", None):
        out = _run(eng, salt)
        assert out["meta_info"]["cached_tokens"] == 0, salt  # another salt, or none: nothing shared
    for salt in ("tenant-a", "tenant-b", None):
        out = _run(eng, salt)
        assert out["meta_info"]["cached_tokens"] == full, salt  # the same salt shares
        assert out["output_ids"] == want["output_ids"]
    # Three copies of the prompt's KV, one per salt, each under its own first page.
    assert len(eng.core.kv_manager.tree.root.children) == 3
    assert eng.memory()["kv_cached_evictable"] >= 3 * full


def test_concurrent_salted_requests_share_nothing(make_engine):
    eng = make_engine(page_size=4)
    _run(eng, "tenant-a")
    rids = [eng.add_request(PROMPT, {**G, "cache_salt": s}) for s in ("tenant-a", "tenant-b", "tenant-a")]
    eng.step()  # all three admitted in one step
    reqs = [eng.core.scheduler.reqs[r] for r in rids]
    assert [r.cached_tokens for r in reqs] == [96, 0, 96]
    assert not set(reqs[1].pages) & (set(reqs[0].pages) | set(reqs[2].pages))
    eng.run_until_idle()
    assert all(eng.result(r)["output_ids"] for r in rids)
