"""NGRAM speculative decoding on the tiny model in fp32: output identical with and without it over
batching, chunked prefill, retraction under a tiny pool, sessions and prefix-cache hits; seeded
sampling identical too (each draw comes from (seed, position), so the output distribution is the
target's); the adaptive pause; the meta fields; books clean after each."""

from __future__ import annotations

import numpy as np
import pytest

from kvledger.errors import ValidationError
from kvledger.spec.adaptive import PAUSE_BELOW
from kvledger.spec.ngram import lookup
from tests.helpers import assert_idle_clean

G = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40}
SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}


def _prompts(n: int = 6) -> list[list[int]]:
    # Repetitive prompts give the n-gram lookup something to find (and the tiny model loops too).
    return [([7 + i, 8 + i, 9 + i, 10 + i] * (3 + i))[: 9 + 5 * i] for i in range(n)]


def _pair(make_engine, **kw):
    return make_engine(**kw), make_engine(**SPEC, **kw)


def _verify_cts(outs) -> int:
    return sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)


def test_lookup_finds_the_longest_then_latest_match():
    seq = np.array([1, 2, 3, 4, 5, 9, 2, 3, 6, 1, 2, 3])
    assert lookup(seq, 2, 1, 12) == [4, 5]  # "1 2 3" beats the later "2 3"
    assert lookup(seq, 2, 4, 12) == []  # no 4-token suffix occurred before
    assert lookup(np.array([4, 4, 8, 4]), 3, 1, 12) == [4, 8, 4]


@pytest.mark.parametrize(
    "kw", [{}, {"page_size": 1}, {"chunked_prefill_size": 16}, {"enable_mixed_chunk": True}]
)
def test_greedy_identical_with_and_without_ngram(make_engine, kw):
    plain, spec = _pair(make_engine, **kw)
    prompts = _prompts()
    ref = plain.generate(input_ids=prompts, sampling_params=G)
    out = spec.generate(input_ids=prompts, sampling_params=G)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert _verify_cts(out) > 0
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in out if "spec_verify_ct" in o["meta_info"])
    assert steps < sum(len(o["output_ids"]) for o in out)  # drafts were accepted
    assert_idle_clean(spec)


def test_greedy_identical_under_retraction(make_engine):
    kw = {"max_total_tokens": 256, "max_running_requests": 8, "chunked_prefill_size": 32}
    plain, spec = _pair(make_engine, **kw)
    prompts = _prompts(7)
    ref = plain.generate(input_ids=prompts, sampling_params=G)
    out = spec.generate(input_ids=prompts, sampling_params=G)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert spec.core.scheduler.total_retractions > 0
    assert_idle_clean(spec)


def test_prefix_cache_hits_and_sessions(make_engine):
    plain, spec = _pair(make_engine)
    shared = [11, 12, 13, 14] * 8
    for eng in (plain, spec):
        eng.generate(input_ids=[*shared, 1], sampling_params=G)
    a = plain.generate(input_ids=[*shared, 2, 3], sampling_params=G)
    b = spec.generate(input_ids=[*shared, 2, 3], sampling_params=G)
    assert a["output_ids"] == b["output_ids"] and b["meta_info"]["cached_tokens"] == 32
    sids = [e.open_session() for e in (plain, spec)]
    for turn in ([5, 6, 7, 5, 6, 7], [5, 6], [9] * 20, [5, 6, 7]):
        r = [e.generate(input_ids=turn, sampling_params={**G, "max_new_tokens": 12}, session_params={"id": s})
             for e, s in zip((plain, spec), sids)]  # fmt: skip
        assert r[0]["output_ids"] == r[1]["output_ids"]
        assert r[0]["meta_info"]["cached_tokens"] == r[1]["meta_info"]["cached_tokens"]
    s = spec.core.sessions.sessions[sids[1]]
    assert len(s.pages) == -(-s.kv_len // 16)  # only the accepted KV went into the session
    assert_idle_clean(spec)


def test_seeded_sampling_identical_with_and_without_ngram(make_engine):
    plain, spec = _pair(make_engine)
    prompts = _prompts(4)
    sps = [
        {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 24, "ignore_eos": True, "seed": s}
        for s in range(16)
    ]
    for p in prompts:
        ref = plain.generate(input_ids=[p] * 16, sampling_params=sps)
        out = spec.generate(input_ids=[p] * 16, sampling_params=sps)
        assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert spec.core.scheduler.proposer is not None
    assert_idle_clean(spec)


def test_stops_inside_an_accepted_run(make_engine):
    plain, spec = _pair(make_engine)
    p = _prompts(1)[0]
    ref = plain.generate(input_ids=p, sampling_params=G)["output_ids"]
    stop = ref[17]
    for sp in ({**G, "stop_token_ids": [stop]}, {**G, "max_new_tokens": 13}):
        a = plain.generate(input_ids=p, sampling_params=sp)
        b = spec.generate(input_ids=p, sampling_params=sp)
        assert (
            a["output_ids"] == b["output_ids"]
            and a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        )


def test_context_length_cuts_speculation(make_engine):
    """Drafts never run past the context; the request ends at it exactly as without speculation."""
    plain, spec = _pair(make_engine, context_length=48)
    p = _prompts(3)[2]  # 19 tokens
    # No max_new_tokens: the default (128) is cut to what the context leaves (an explicit 100: a 400).
    sp = {"temperature": 0, "ignore_eos": True}
    a = plain.generate(input_ids=p, sampling_params=sp)
    b = spec.generate(input_ids=p, sampling_params=sp)
    assert a["output_ids"] == b["output_ids"] and len(b["output_ids"]) == 48 - len(p)
    assert b["meta_info"]["finish_reason"]["type"] == "length" and b["meta_info"]["spec_verify_ct"] > 0
    assert_idle_clean(spec)


def test_adaptive_pause_when_drafts_keep_failing(make_engine):
    eng = make_engine(**SPEC)
    req_spec = None

    class Wrong:
        """Every draft is wrong: the rule must pause drafting for the request."""

        def __init__(self, inner):
            self.inner = inner
            self.offered = 0

        def propose(self, req):
            nonlocal req_spec
            req_spec = req.spec
            d = self.inner.propose(req)
            self.offered += bool(d)
            return [(t + 1) % 256 for t in d]

    eng.core.scheduler.proposer = Wrong(eng.core.scheduler.proposer)
    out = eng.generate(input_ids=[5, 6, 7] * 6, sampling_params={**G, "max_new_tokens": 60})
    assert len(out["output_ids"]) == 60
    assert req_spec.accepted == 0 and req_spec.verify_ct < 60 / 3  # paused most of the time
    assert req_spec.ema >= PAUSE_BELOW or req_spec.paused_until > 0


def test_bad_speculative_settings_are_refused(tiny_loaded):
    from kvledger import Engine

    for kw in ({"speculative_algorithm": "EAGLE"}, {**SPEC, "speculative_num_draft_tokens": 0}):
        with pytest.raises(ValidationError):
            Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=256, **kw)


def _chi2_homogeneity(a: list[int], b: list[int], min_count: int = 8) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom for "a and b come from one distribution"
    (categories seen fewer than ``min_count`` times in both together are pooled)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb))
    big = [c for c in cats if ca[c] + cb[c] >= min_count]
    rows = [(ca[c], cb[c]) for c in big]
    rest = (sum(ca[c] for c in cats if c not in big), sum(cb[c] for c in cats if c not in big))
    if sum(rest):
        rows.append(rest)
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(rows) - 1


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_sampled_distribution_is_the_targets(make_engine, tiny_llama, algo):
    """Unseeded sampling, 600 runs each: the tokens drawn at several output positions have the same
    distribution with and without NGRAM (chi-square homogeneity at the 0.1% level, Wilson-Hilferty
    quantile). A low temperature makes the tiny model's drafts both accepted and rejected often
    (about a quarter accepted); the engines' own seeds fix the run, so it cannot flake."""
    plain = make_engine(seed=3)
    extra = {"speculative_draft_model_path": tiny_llama} if algo == "STANDALONE" else {}
    spec = make_engine(seed=3, speculative_algorithm=algo, **extra)
    prompt = _prompts(1)[0]
    sp = {"temperature": 0.08, "max_new_tokens": 12, "ignore_eos": True}
    outs = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        outs[name] = [o for _ in range(10) for o in eng.generate(input_ids=[prompt] * 60, sampling_params=sp)]
    totals = spec.core.scheduler.spec_totals
    assert totals.accepted > 300 and totals.drafted - totals.accepted > 300  # both paths, often
    for pos in (4, 8, 11):
        a = [o["output_ids"][pos] for o in outs["plain"]]
        b = [o["output_ids"][pos] for o in outs["spec"]]
        stat, df = _chi2_homogeneity(a, b)
        z = 3.09  # one-sided 0.1%
        crit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
        assert stat < crit, (pos, stat, crit, df)
    assert_idle_clean(spec)


# -- STANDALONE: a draft model ---------------------------------------------------------------------


@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("kw", [{}, {"page_size": 1, "chunked_prefill_size": 16}])
def test_draft_model_output_identical(make_engine, tiny_llama, tiny_qwen3, same, kw):
    """With the target itself as the draft nearly every draft is accepted; with another model few
    are. Either way the output is the target's, and the books balance."""
    draft = tiny_llama if same else tiny_qwen3
    plain = make_engine(**kw)
    spec = make_engine(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft, **kw)
    prompts = _prompts()
    ref = plain.generate(input_ids=prompts, sampling_params=G)
    out = spec.generate(input_ids=prompts, sampling_params=G)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    t = spec.core.scheduler.spec_totals
    assert t.verify_ct > 0
    if same:
        assert t.accepted > 0.9 * t.drafted
    assert_idle_clean(spec)


def _accepted_fraction(eng, since: tuple[int, int]) -> float:
    t = eng.core.scheduler.spec_totals
    return (t.accepted - since[0]) / max(t.drafted - since[1], 1)


def test_draft_model_under_retraction_sessions_and_sampling(make_engine, tiny_llama):
    """The target as its own draft: drafts stay nearly all accepted across retraction (the draft
    K/V is recomputed after a new admission) and session turns, so the draft K/V tracks the pages."""
    kw = {"max_total_tokens": 256, "max_running_requests": 8, "chunked_prefill_size": 32}
    plain = make_engine(**kw)
    spec = make_engine(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_llama, **kw)
    t = spec.core.scheduler.spec_totals
    prompts = _prompts(7)
    ref = plain.generate(input_ids=prompts, sampling_params=G)
    assert [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=G)] == [
        r["output_ids"] for r in ref
    ]
    assert spec.core.scheduler.total_retractions > 0
    assert _accepted_fraction(spec, (0, 0)) > 0.9
    since = (t.accepted, t.drafted)
    sids = [e.open_session() for e in (plain, spec)]
    for turn in ([5, 6, 7, 5, 6, 7], [5, 6], [9] * 20):
        r = [e.generate(input_ids=turn, sampling_params={**G, "max_new_tokens": 10}, session_params={"id": s})
             for e, s in zip((plain, spec), sids)]  # fmt: skip
        assert r[0]["output_ids"] == r[1]["output_ids"]
    assert _accepted_fraction(spec, since) > 0.9
    sps = [{"temperature": 0.8, "max_new_tokens": 16, "ignore_eos": True, "seed": s} for s in range(8)]
    a = plain.generate(input_ids=[prompts[0]] * 8, sampling_params=sps)
    b = spec.generate(input_ids=[prompts[0]] * 8, sampling_params=sps)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert_idle_clean(spec)


def test_draft_model_settings_are_checked(tiny_loaded, tmp_path):
    from kvledger import Engine
    from kvledger.errors import ModelLoadError
    from tests.helpers import build_tiny_model

    base = {"loaded_model": tiny_loaded, "dtype": "float32", "max_total_tokens": 256}
    with pytest.raises(ValidationError):
        Engine(**base, speculative_algorithm="STANDALONE")  # no draft model
    with pytest.raises(ValidationError):
        Engine(
            **base, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tmp_path / "none")
        )
    other = build_tiny_model(str(tmp_path / "v300"), "llama", vocab_size=300)
    with pytest.raises(ModelLoadError, match="same tokenizer"):
        Engine(**base, speculative_algorithm="STANDALONE", speculative_draft_model_path=other)
