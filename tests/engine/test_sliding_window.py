"""Sliding-window KV as a ledger state (memory/window.py): a model whose every layer slides gives back
the pages that leave the window while its requests run. Counted through the ledger, token-exact
against transformers, and through the prefix cache, retraction, abort, sessions, overlap and
speculative decoding with strict books (every engine audited clean at teardown)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from kvledger import Engine, kernels
from kvledger.errors import MemoryLedgerError, ValidationError
from kvledger.memory import OUT_OF_WINDOW, WindowKV
from tests.helpers import assert_idle_clean, build_tiny_model, hf_greedy

W = 16  # the tiny model's window: every layer attends to its query and the 15 tokens before it
G = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def window_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_window")), "mistral", seed=3, sliding_window=W)


@pytest.fixture(scope="module")
def window_loaded(window_model):
    from kvledger.model import load_model

    return load_model(window_model)


@pytest.fixture(scope="module")
def window_hf(window_model):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        window_model, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture
def make(window_loaded):
    """Strict-memory engines on the windowed model, each audited clean at teardown."""
    engines = []

    def make(**kw):
        opts = dict(dtype="float32", page_size=4, max_total_tokens=2048, strict_memory=True)
        opts.update(kw)
        eng = Engine(loaded_model=window_loaded, **opts)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        assert_idle_clean(eng)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def _req(eng, rid: str):
    return eng.core.scheduler.reqs[rid]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_pages_leave_the_request_as_decode_passes_the_window(make, prefix_cache):
    """Step by step: the request holds every page from the window of the position it computes next
    on, and less than a run of pages before it; what it gave back is counted out of window by the
    ledger (its holding less those, exactly), and is cached (prefix cache on: evictable) or free."""
    eng = make(enable_prefix_cache=prefix_cache)
    kvm, ps = eng.core.kv_manager, 4
    win = kvm.window
    assert win is not None and win.window == W and win.run_pages == W // ps
    rid = eng.add_request(_prompt(6), {**G, "max_new_tokens": 70})
    free0 = eng.memory()["kv_free"]
    seen_out = 0
    while eng.result(rid, pop=False) is None:
        req = _req(eng, rid)
        first_query = req.kv_len  # the position this step computes first (no overlap here)
        eng.step()
        if req.slot is None:
            continue
        need = win.first_needed_page(first_query)
        out = req.num_out_pages
        assert need - win.run_pages < out <= need, (first_query, out)
        assert req.pages[:out] == [OUT_OF_WINDOW] * out and OUT_OF_WINDOW not in req.pages[out:]
        # The page table keeps a placeholder (-1) for them, the locations of the pages held after.
        row = eng.core.runner.page_table.req_to_token[req.slot]
        assert (row[: out * ps] == -1).all() and (row[out * ps : req.kv_len] >= 0).all()
        m = eng.memory()
        # The ledger's count: the request holds its entries less the out-of-window ones, exactly.
        assert m["kv_private"] == (len(req.pages) - out) * ps
        assert m["window"]["out_of_window_tokens"] == out * ps
        # ... so what it holds stays within the window, a run and the page being written.
        assert len(req.pages) - out <= (W + ps - 1) // ps + win.run_pages + 1
        if prefix_cache:
            assert m["kv_cached_evictable"] == out * ps  # given to the tree, evictable
        else:
            assert m["kv_cached_evictable"] == 0 and m["kv_free"] == free0 - m["kv_private"]
        seen_out = max(seen_out, out)
    assert seen_out >= (6 + 69 - W) // ps - win.run_pages
    released = eng.memory()["window"]["released_tokens_total"]
    assert released == seen_out * ps
    assert eng.memory()["window"]["released_to_cache_tokens_total"] == (released if prefix_cache else 0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_equals_transformers_with_release(make, window_hf, backend, page_size):
    """Prompts longer than the window, prefilled in chunks beside decodes, pages given back as they
    go: every token equal to transformers' (fp32, eager attention with its sliding-window mask)."""
    if backend == "cpu" and not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    eng = make(page_size=page_size, chunked_prefill_size=16, enable_mixed_chunk=True, attention_backend=backend)
    prompts = [_prompt(n, seed=n) for n in (5, 23, 50, 71)]
    outs = eng.generate(input_ids=prompts, sampling_params={**G, "max_new_tokens": 30})
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == hf_greedy(window_hf, p, 30), len(p)
    assert eng.memory()["window"]["released_tokens_total"] > 0


def test_prefix_hit_after_release_equals_a_cold_run(make, window_hf):
    """A finished request's released pages went to the tree as a prefix, its remaining KV after
    them: a later prompt sharing it hits that prefix and answers as a cold run does."""
    eng = make(chunked_prefill_size=16)
    base = _prompt(60, seed=1)
    eng.generate(input_ids=base, sampling_params={**G, "max_new_tokens": 20})
    assert eng.memory()["window"]["released_to_cache_tokens_total"] > 0
    for suffix_seed in (2, 3):
        p = base[:52] + _prompt(9, seed=suffix_seed)
        o = eng.generate(input_ids=p, sampling_params={**G, "max_new_tokens": 25})
        assert o["meta_info"]["cached_tokens"] == 52
        assert o["output_ids"] == hf_greedy(window_hf, p, 25)


def test_a_released_prefix_evicted_mid_request_is_not_extended(make, window_hf):
    """The tree evicts the prefix a running request gave back: its later runs are freed (they would
    hang below a path the tree no longer has), nothing of it is cached at its end, and a later
    request with its prompt finds no hit beyond what remains (here nothing) and answers right."""
    eng = make(chunked_prefill_size=16)
    kvm = eng.core.kv_manager
    p = _prompt(40, seed=4)
    rid = eng.add_request(p, {**G, "max_new_tokens": 40})
    while _req(eng, rid).num_out_pages < 8:
        eng.step()
    cached = kvm.window.cached_pages
    assert kvm.tree.evict(10**6) == cached  # (a safe point: between steps) every released page
    assert _req(eng, rid).window_node is not None and not kvm.tree.holds_path(_req(eng, rid).window_node)
    eng.run_until_idle()
    out = eng.result(rid)["output_ids"]
    assert out == hf_greedy(window_hf, p, 40)
    assert kvm.window.cached_pages == cached  # the runs after the eviction were freed
    assert eng.memory()["kv_cached_evictable"] == 0  # nor was the rest cached at its end
    again = eng.generate(input_ids=p, sampling_params={**G, "max_new_tokens": 40})
    assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == out
    # Evicted after its last release: it ends (an abort still commits what it computed) without
    # another slide, and its KV must not go below the evicted node either.
    eng.flush_cache()
    rid = eng.add_request(_prompt(40, seed=5), {**G, "max_new_tokens": 40})
    while _req(eng, rid).num_out_pages < 8:
        eng.step()
    assert kvm.tree.evict(10**6) > 0
    eng.abort(rid)
    eng.run_until_idle()
    assert eng.memory()["kv_cached_evictable"] == 0


def test_retraction_and_abort_of_requests_with_released_pages(make, window_hf):
    """Retracted with pages out of window: its KV goes to the tree as far as it is a prefix there, it
    is recomputed (largely from the cache) to the same output. Aborted: every page back."""
    eng = make(chunked_prefill_size=16)
    prompts = [_prompt(30, seed=10 + i) for i in range(3)]
    rids = [eng.add_request(p, {**G, "max_new_tokens": 40}, rid=f"r{i}") for i, p in enumerate(prompts)]
    while min(_req(eng, r).num_out_pages for r in rids) < 4:
        eng.step()
    eng.abort("r2")
    eng.step()  # (its safe point)
    assert eng.result("r2")["meta_info"]["finish_reason"]["type"] == "abort"
    eng.pause_generation(mode="retract")
    assert all(_req(eng, r).slot is None for r in rids[:2])  # requeued, nothing held
    assert_idle_clean_while_paused(eng)
    eng.continue_generation()
    eng.run_until_idle()
    for i in (0, 1):
        assert eng.result(rids[i])["output_ids"] == hf_greedy(window_hf, prompts[i], 40)
    assert eng.core.scheduler.total_retractions == 2


def assert_idle_clean_while_paused(eng) -> None:
    report = eng.audit()
    assert report.ok, report.describe()
    m = eng.memory()
    assert m["kv_private"] == 0 and m["req_slots_free"] == m["req_slots_total"], m


def test_retraction_under_a_small_pool(make, window_hf):
    """A pool too small for four long requests at once: retraction and recompute, every output
    exact, with pages given back as they go (what lets more of them run at once)."""
    eng = make(max_total_tokens=160, chunked_prefill_size=16)
    prompts = [_prompt(40 + 7 * i, seed=20 + i) for i in range(4)]
    outs = eng.generate(input_ids=prompts, sampling_params={**G, "max_new_tokens": 45})
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == hf_greedy(window_hf, p, 45)
    assert eng.memory()["window"]["released_tokens_total"] > 0


@pytest.mark.parametrize("page_size", [1, 4, 6])
def test_session_turns_on_a_windowed_model(make, page_size):
    """A session keeps the pages its next turn reads (not the released ones): the next turn borrows
    them and answers as the full prompt does; a turn rewinding into the released part recomputes.
    (Pages of 6 do not divide the window: the turn's release stops at the window of the last whole
    page's end, where the next turn's first query is.)"""
    eng = make(page_size=page_size, chunked_prefill_size=16)
    ref = make(page_size=page_size, enable_prefix_cache=False)
    sid = eng.open_session()
    history: list[int] = []
    for i, n in enumerate((30, 12, 25)):
        t = _prompt(n, seed=30 + i)
        # (24 new tokens: turns end off page boundaries, after a release near the end)
        o = eng.generate(input_ids=t, sampling_params={**G, "max_new_tokens": 24}, session_params={"id": sid})
        want = ref.generate(input_ids=history + t, sampling_params={**G, "max_new_tokens": 24})["output_ids"]
        assert o["output_ids"] == want, i
        if i:
            assert o["meta_info"]["cached_tokens"] == (len(history) - 1) // page_size * page_size
        history += t + o["output_ids"]
        s = eng.core.kv_manager.sessions.by_id[sid]
        assert s.num_out > 0 and s.pages[: s.num_out] == [OUT_OF_WINDOW] * s.num_out
        held = eng.sessions()[0]["held_tokens"]
        assert held == eng.memory()["kv_session"] <= W + 2 * page_size  # its window, not its history
    # A rewind to an offset inside the released part: nothing borrowed, the history recomputed.
    t = _prompt(5, seed=40)
    o = eng.generate(
        input_ids=t, sampling_params={**G, "max_new_tokens": 10}, session_params={"id": sid, "offset": 20}
    )
    assert o["meta_info"]["cached_tokens"] == 0
    want = ref.generate(input_ids=history[:20] + t, sampling_params={**G, "max_new_tokens": 10})["output_ids"]
    assert o["output_ids"] == want
    # An aborted turn leaves the session as it was.
    rid = eng.add_request(_prompt(30, seed=41), {**G, "max_new_tokens": 40}, session_params={"id": sid})
    while _req(eng, rid).num_out_pages == 0:
        eng.step()
    before = eng.memory()["kv_session"]
    eng.abort(rid)
    eng.run_until_idle()
    assert eng.memory()["kv_session"] == before
    eng.close_session(sid)


def test_overlap_and_ngram_drafts_near_the_window_edge(make):
    """Overlap scheduling: a launched step still reads its window, so pages go back only outside the
    window of the earliest position a step in flight computes. NGRAM drafts verified across the
    window's edge. Both give the plain engine's tokens."""
    rng = random.Random(7)
    motif = [rng.randrange(3, 256) for _ in range(6)]
    prompts = [motif * 8 + _prompt(5, seed=50), _prompt(45, seed=51)]
    sp = {**G, "max_new_tokens": 40}
    want = [o["output_ids"] for o in make(enable_prefix_cache=False).generate(input_ids=prompts, sampling_params=sp)]
    over = make(disable_overlap_schedule=False, chunked_prefill_size=16)
    assert over.core.overlap
    # After each release: no page a launched step still reads was given back (the window of every
    # row in flight holds KV), though the request's KV length is already past that step.
    sched, kvm, checked = over.core.scheduler, over.core.kv_manager, []
    slide = sched._slide_windows

    def checked_slide():
        slide()
        for f in sched.in_flight.flights.values():
            for r, start in zip(f.reqs, f.starts):
                if r.slot is not None:
                    assert r.num_tree_pages + r.num_out_pages <= max(
                        r.num_tree_pages, kvm.window.first_needed_page(start)
                    ), (r.rid, start, r.kv_len)
                    checked.append(r.num_out_pages > 0)

    sched._slide_windows = checked_slide
    assert [o["output_ids"] for o in over.generate(input_ids=prompts, sampling_params=sp)] == want
    assert over.core.overlap_stats["overlapped"] > 0 and over.memory()["window"]["released_tokens_total"] > 0
    assert any(checked)
    spec = make(speculative_algorithm="ngram", speculative_num_draft_tokens=4, chunked_prefill_size=16)
    assert [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=sp)] == want
    assert spec.core.scheduler.spec_totals.drafted > 0
    assert spec.memory()["window"]["released_tokens_total"] > 0


def test_the_hierarchical_cache_and_released_pages(make, window_hf):
    """The tiers copy tree nodes only, and released pages are in the tree only while they hold KV:
    a prefix given back out of window is backed up, pushed out of L1 and loaded back for the same
    prompt, which answers as before. A session whose turn gave back pages is dropped under
    pressure, never demoted (L2 holds a session as one run), and its next turn recomputes."""
    eng = make(enable_hierarchical_cache=True, hicache_write_policy="write_through", hicache_ratio=4,
               max_total_tokens=512, chunked_prefill_size=16)  # fmt: skip
    kvm = eng.core.kv_manager
    p = _prompt(80, seed=60)
    first = eng.generate(input_ids=p, sampling_params={**G, "max_new_tokens": 30})
    assert first["output_ids"] == hf_greedy(window_hf, p, 30)
    assert eng.memory()["window"]["released_to_cache_tokens_total"] > 0
    h = eng.memory()["hicache"]
    assert h["backed_up_pages"] > 0, h
    assert all(len(n.host) == len(n.pages) for n in kvm.tree.nodes())  # every L1 node has its copy
    kvm.tree.evict(10**6)  # (between steps) L1 out, the copies stay
    again = eng.generate(input_ids=p, sampling_params={**G, "max_new_tokens": 30})
    assert again["output_ids"] == first["output_ids"] and again["meta_info"]["cached_tokens"] >= 76
    assert eng.memory()["hicache"]["l2_hit_tokens"] >= 76
    sid = eng.open_session()
    t = _prompt(60, seed=61)
    o1 = eng.generate(input_ids=t, sampling_params={**G, "max_new_tokens": 24}, session_params={"id": sid})
    s = kvm.sessions.by_id[sid]
    assert s.num_out > 0
    kvm.sessions.evict_idle(10**6)
    h = eng.memory()["hicache"]
    assert h["session_demotions"] == 0 and s.pages == [] and s.kv_len == 0, h
    t2 = _prompt(7, seed=62)
    o2 = eng.generate(input_ids=t2, sampling_params={**G, "max_new_tokens": 10}, session_params={"id": sid})
    assert o2["meta_info"]["cached_tokens"] == 0
    assert o2["output_ids"] == hf_greedy(window_hf, t + o1["output_ids"] + t2, 10)
    eng.close_session(sid)


@pytest.mark.parametrize("broken", ["freed, still counted as held", "marked out, never freed"])
def test_the_books_catch_a_release_without_its_accounting(window_loaded, monkeypatch, broken):
    """Break the release once: pages freed but still counted as the request's (a page with two
    owners), or marked out of window but never freed (a page with none). Strict books raise."""

    def slide(self, req, first_query):
        start, end = self.releasable(req, first_query)
        if end - start < self.run_pages:
            return 0
        if broken.startswith("freed"):
            self.kvm.free(req.pages[start:end], "broken slide")
        else:
            req.pages[start:end] = [OUT_OF_WINDOW] * (end - start)
            req.num_out_pages += end - start
            self.kvm._map(req, start, [OUT_OF_WINDOW] * (end - start))
        return end - start

    monkeypatch.setattr(WindowKV, "slide", slide)
    eng = Engine(loaded_model=window_loaded, dtype="float32", page_size=4, max_total_tokens=512, strict_memory=True)
    try:
        with pytest.raises(MemoryLedgerError, match="conservation") as e:
            eng.generate(input_ids=_prompt(10), sampling_params={**G, "max_new_tokens": 40})
        assert ("several owners" if broken.startswith("freed") else "leaked pages") in str(e.value)
    finally:
        with contextlib.suppress(MemoryLedgerError):  # (the broken request's end trips them again)
            eng.shutdown(drain_timeout_s=1)


def test_the_audit_catches_a_page_given_back_inside_the_window(make):
    """A release one page too far (the window of the next token still reads it) balances the books
    but not the window rule: the full audit names it."""
    eng = make(enable_prefix_cache=False)
    kvm = eng.core.kv_manager
    rid = eng.add_request(_prompt(10), {**G, "max_new_tokens": 40})
    while _req(eng, rid).num_out_pages < 4:
        eng.step()
    req = _req(eng, rid)
    assert kvm.ledger.audit(count=False).ok
    # Give back the held pages up to and including the first one the next token's window reads.
    k, fn = req.num_tree_pages + req.num_out_pages, kvm.window.first_needed_page(req.kv_len)
    pages = req.pages[k : fn + 1]
    kvm.free(pages, "test")
    req.pages[k : fn + 1] = [OUT_OF_WINDOW] * len(pages)
    req.num_out_pages += len(pages)
    assert kvm.ledger.page_counts()["free"] + kvm.ledger.page_counts()["private"] == kvm.pages.num_pages
    report = kvm.ledger.audit(count=False)
    assert any("out of window, but the window of position" in p for p in report.problems), report.describe()
    eng.abort(rid)  # (its page table still has the page: nothing read it)


def test_windowed_models_refuse_what_does_not_compose(window_model, window_loaded):
    """The compatibility table's rows: a draft model (its KV in the target's pages, full attention)
    and PD (the transfer sends whole prompts' pages) are refused at start with the reason."""
    with pytest.raises(ValidationError, match=r"sliding-window release .* draft model .*: the draft model's KV"):
        Engine(loaded_model=window_loaded, dtype="float32", speculative_algorithm="standalone",
               speculative_draft_model_path=window_model)  # fmt: skip
    with pytest.raises(ValidationError, match=r"sliding-window release .* PD disaggregation"):
        Engine(loaded_model=window_loaded, dtype="float32", disaggregation_mode="prefill")


def test_a_model_with_full_layers_keeps_every_page(tmp_path):
    """Mixed windowed and full layers (Qwen2 sliding from layer 1): the full layers read every
    position, so nothing is released (no window in the books)."""
    path = build_tiny_model(str(tmp_path), "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    eng = Engine(path, dtype="float32", page_size=4, max_total_tokens=512, strict_memory=True)
    try:
        assert eng.core.model.cfg.layer_windows() == [None, 8]
        assert eng.core.kv_manager.window is None and "window" not in eng.memory()
        eng.generate(input_ids=_prompt(30), sampling_params={**G, "max_new_tokens": 10})
        assert_idle_clean(eng)
    finally:
        eng.shutdown()
