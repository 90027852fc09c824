"""HiSparse (issue 31): sparse decode over a hot page budget with the KV history in a host pool.

fp32: with every page selected the output is dense attention's (and transformers'), on both attention
backends; the books name the host and hot pages while a request decodes and hold none once idle; every
way a request ends gives them back (finish, abort before and after its first sparse step, retraction,
a PD-less health check); admission reserves prompt + max new tokens of host room; a reused request slot
starts clean; NGRAM drafts go on for dense rows and never for sparse ones; a session that crosses the
threshold decodes sparsely, exact across turns, a rewind, an abort and a close mid-turn. Quest's page
choice finds the page whose keys answer the query.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvledger.common import FinishReason
from kvledger.errors import ValidationError
from tests.helpers import hf_greedy, step_until

SP = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
ALL_PAGES = dict(enable_hisparse=True, hisparse_min_context=0, hisparse_top_k_pages=60, hisparse_hot_pages=64)
# (the tiny model has 2 layers: no dense layers, or every layer would read every page)
SMALL = dict(enable_hisparse=True, hisparse_min_context=0, hisparse_top_k_pages=2, hisparse_hot_pages=6,
             hisparse_dense_layers=0)  # fmt: skip


def prompts(n: int, lens=(150, 300, 90, 513), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(lens[i % len(lens)])] for i in range(n)]


def outputs(eng, ps: list[list[int]], sp: dict = SP) -> list[list[int]]:
    return [r["output_ids"] for r in eng.generate(input_ids=ps, sampling_params=sp)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_page_selected_is_dense_attention(make_engine, tiny_llama_hf, backend):
    """top-k past the sequence's pages: every page read, in order, so the sums are dense attention's:
    greedy output equals the dense engine's and transformers' token for token, batched."""
    ps = prompts(4)
    dense = outputs(make_engine(attention_backend=backend), ps)
    eng = make_engine(attention_backend=backend, **ALL_PAGES)
    assert outputs(eng, ps) == dense
    assert dense[1] == hf_greedy(tiny_llama_hf, ps[1], SP["max_new_tokens"])
    assert eng.memory()["hisparse"]["requests_begun"] == 4  # they did decode sparsely


def test_sparse_rows_read_fewer_pages_and_both_backends_agree(make_engine):
    """A small budget reads 5 of 33 pages: output differs from dense (the random model's attention is
    flat), but both backends compute the same selection and the same tokens: the torch reference
    through hot-page copies, the cpu backend reading the host pages in place (the C++ kernel)."""
    ps = prompts(4)
    ref = make_engine(attention_backend="torch", **SMALL)
    torch_out = outputs(ref, ps)
    w = ref.core.runner.sparse
    assert w.misses > 0 and w.hits > 0 and w.in_place_forwards == 0
    eng = make_engine(attention_backend="cpu", **SMALL)
    assert outputs(eng, ps) == torch_out
    w = eng.core.runner.sparse
    assert w.in_place_forwards > 0 and w.misses == 0  # no copy into hot pages at all


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_books_name_host_and_hot_pages_while_decoding(make_engine, backend):
    """The torch reference copies selected pages into ``--hisparse-hot-pages`` KV-pool pages; the cpu
    kernel reads the host pool in place, so its requests hold one hot page (the write page) only."""
    from kvledger import kernels

    if backend == "cpu" and not kernels.load():
        pytest.skip("the C++ kernels do not load here")
    eng = make_engine(attention_backend=backend, **SMALL)
    eng.add_request(input_ids=prompts(1, (300,))[0], sampling_params={**SP, "max_new_tokens": 40}, rid="long")
    core = eng.core
    step_until(eng, lambda: core.scheduler.reqs.get("long") is not None and core.scheduler.reqs["long"].sparse
               is not None and core.scheduler.reqs["long"].sparse.active and core.scheduler.reqs["long"].kv_len > 310)  # fmt: skip
    m = eng.memory()
    ps = 16
    hot_pages = SMALL["hisparse_hot_pages"] if backend == "torch" else 1
    assert m["kv_hisparse_hot"] == hot_pages * ps and m["hisparse"]["hot_pages"] == hot_pages
    assert m["hisparse"]["host_held"] == -(-(300 + 40) // ps) * ps  # prompt + max new, reserved at admission
    assert m["kv_private"] == 0  # its dense pages went back after the first sparse step
    runs = core.view.page_map()["runs"]
    hot = [r for r in runs if r["kind"] == "hisparse_hot"]
    assert sum(r["count"] for r in hot) == hot_pages
    assert all(r["owner"] == "req long [hisparse hot]" for r in hot)
    assert eng.audit().ok
    assert (core.runner.sparse.in_place_forwards > 0) == (backend == "cpu")
    # The prompt's pages went to the prefix cache: a second request on it is a cache hit.
    eng.run_until_idle()
    again = eng.generate(input_ids=prompts(1, (300,))[0], sampling_params=SP)
    assert again["meta_info"]["cached_tokens"] >= 288


def test_a_leaked_host_page_is_found_by_the_audit(tiny_loaded):
    """The host pool's books: a page nobody holds is a leak, named by its last owner (production mode
    takes it back; the engine is made here, not by ``make_engine``, whose teardown wants no violation)."""
    from kvledger import Engine

    eng = Engine(loaded_model=tiny_loaded, dtype="float32", page_size=16, max_total_tokens=4096, **SMALL)
    eng.generate(input_ids=prompts(1)[0], sampling_params=SP)
    eng.run_until_idle()
    sparse = eng.core.kv_manager.sparse
    lost = sparse.host.alloc_many(2, "req ghost [hisparse host]")
    report = eng.audit()
    assert sorted(report.leaked_sparse_host_pages) == sorted(lost)
    assert "req ghost [hisparse host]" in report.describe()
    assert eng.core.kv_manager.sparse.host.num_free == sparse.host.num_ids  # production: reclaimed
    eng.shutdown()


@pytest.mark.parametrize("when", ["prefill", "first_sparse_step", "decoding"])
def test_abort_at_every_point_gives_everything_back(make_engine, when):
    eng = make_engine(chunked_prefill_size=64, **SMALL)
    eng.add_request(input_ids=prompts(1, (300,))[0], sampling_params={**SP, "max_new_tokens": 60}, rid="a")
    eng.add_request(input_ids=prompts(1, (200,), seed=1)[0], sampling_params=SP, rid="b")
    s = eng.core.scheduler

    def at() -> bool:
        r = s.reqs.get("a")
        if r is None or r.sparse is None:
            return False
        if when == "prefill":
            return 0 < r.kv_len < 300
        if when == "first_sparse_step":
            return r.sparse.active and r.pages  # begun: dense pages not yet given back
        return r.sparse.active and r.kv_len > 320

    if when == "first_sparse_step":
        # Between schedule (begin) and update (dense pages go): it ends inside the step, holding both.
        orig = s.update

        def update(sched, result):
            r = s.reqs.get("a")
            if r is not None and r.sparse is not None and r.sparse.active and r.pages and r.to_finish is None:
                r.mark_finish(FinishReason("abort", "aborted in its first sparse step", status=499))
            return orig(sched, result)

        s.update = update
        eng.run_until_idle()
    else:
        step_until(eng, at)
        eng.abort("a")
        eng.run_until_idle()
    assert eng.memory()["hisparse"]["host_held"] == 0


def test_retraction_gives_sparse_pages_back_and_output_stays(make_engine):
    """Running requests retracted mid-decode (pause with mode retract): their host and hot pages go back
    through the release path; admitted again they recompute and go sparse again, and with every page
    selected the output is still dense attention's."""
    ps = prompts(3, (120, 200, 90))
    dense = outputs(make_engine(), ps)
    eng = make_engine(**ALL_PAGES)
    for i, p in enumerate(ps):
        eng.add_request(input_ids=p, sampling_params=SP, rid=f"r{i}")
    s = eng.core.scheduler
    step_until(eng, lambda: all(r.sparse is not None and r.sparse.active for r in s.running) and len(s.running) == 3)
    eng.pause_generation(mode="retract")
    eng.run_until_idle()
    assert eng.memory()["hisparse"]["host_held"] == 0 and eng.memory()["kv_hisparse_hot"] == 0
    assert not eng.core.runner.sparse.slots
    eng.continue_generation()
    eng.run_until_idle()
    got = [eng.result(f"r{i}")["output_ids"] for i in range(3)]
    assert got == dense
    assert eng.memory()["hisparse"]["requests_begun"] == 6


def test_admission_reserves_prompt_plus_max_new_tokens_of_host_room(make_engine):
    """SGLang's overflow: every decoded token is backed up too. A request that can never fit is a 400
    before anything is held; two that fit only one at a time run one after the other."""
    eng = make_engine(max_total_tokens=1024, hisparse_host_ratio=0.5, **SMALL)  # host: 512 tokens
    with pytest.raises(ValidationError, match="HiSparse host pool"):
        eng.generate(input_ids=prompts(1, (300,))[0], sampling_params={**SP, "max_new_tokens": 300})
    ps = prompts(2, (200, 210))
    sp = {**SP, "max_new_tokens": 100}  # 300 tokens of host each: one at a time
    dense = outputs(make_engine(), ps, sp)
    out = eng.generate(input_ids=ps, sampling_params=[sp, sp])
    assert len(out) == 2
    held = eng.memory()["hisparse"]
    assert held["host_held"] == 0 and held["requests_begun"] == 2
    eng2 = make_engine(max_total_tokens=1024, hisparse_host_ratio=0.5,
                       **{**ALL_PAGES, "hisparse_top_k_pages": 36, "hisparse_hot_pages": 40})  # fmt: skip
    assert outputs(eng2, ps, sp) == dense


def test_a_reused_request_slot_starts_clean(make_engine):
    """Two slots, twelve requests: every slot is reused several times. Each request's sparse output
    equals the same request alone on a fresh engine (dirty LRU maps or summaries would change it)."""
    ps = prompts(12, (140, 260, 200, 330))
    eng = make_engine(max_running_requests=2, **SMALL)
    got = outputs(eng, ps)
    for i in (0, 5, 11):
        alone = make_engine(max_running_requests=1, **SMALL)
        assert outputs(alone, [ps[i]]) == [got[i]], i
        alone.shutdown()


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_drafts_for_dense_rows_never_sparse_ones(make_engine, tiny_llama, algo):
    """Sparse rows decode one token a step, with NGRAM drafts as with a draft model (a verify would
    need sparse extends: each draft's own page choice, and summaries without the rejected drafts'
    keys); the short prompt's dense row still speculates. fp32 all-pages output equals plain dense
    decoding, and the books are clean (the draft model's pages included)."""
    from tests.helpers import assert_idle_clean

    ps = [list(range(10, 40)) * 10, [5, 6, 7, 8] * 4]  # a long repetitive prompt (sparse), a short one
    dense = outputs(make_engine(), ps)
    draft = {"speculative_draft_model_path": tiny_llama} if algo == "STANDALONE" else {}
    eng = make_engine(speculative_algorithm=algo, speculative_num_draft_tokens=4, **draft,
                      **{**ALL_PAGES, "hisparse_min_context": 100})  # fmt: skip
    res = eng.generate(input_ids=ps, sampling_params=[SP, SP])
    assert [r["output_ids"] for r in res] == dense
    assert "spec_verify_ct" not in res[0]["meta_info"]  # the sparse row never drafted (0: left out)
    assert res[1]["meta_info"]["spec_verify_ct"] > 0
    assert eng.memory()["hisparse"]["requests_begun"] == 1
    assert_idle_clean(eng)


def test_settings_are_checked(make_engine):
    from kvledger.config import HiSparseSettings

    with pytest.raises(ValidationError, match="must hold the pages a step reads"):
        make_engine(enable_hisparse=True, hisparse_top_k_pages=8, hisparse_hot_pages=8)
    with pytest.raises(ValidationError, match="at least one page"):
        make_engine(enable_hisparse=True, hisparse_budget_tokens=8)  # pages of 16
    with pytest.raises(ValidationError, match="the budget's 64 pages"):
        make_engine(enable_hisparse=True, hisparse_budget_tokens=1024, hisparse_hot_pages=32)
    for bad in ("hisparse_budget_tokens", "hisparse_dense_layers"):
        with pytest.raises(ValidationError, match=f"{bad} must be >= 0"):
            make_engine(enable_hisparse=True, **{bad: -1})
    assert HiSparseSettings(hisparse_budget_tokens=1024).top_k_pages(16) == 64  # whole pages of the budget
    assert HiSparseSettings(hisparse_budget_tokens=1000, hisparse_top_k_pages=5).top_k_pages(16) == 62
    assert HiSparseSettings(hisparse_top_k_pages=5).top_k_pages(16) == 5
    with pytest.raises(ValidationError, match="selects whole pages"):
        make_engine(enable_hisparse=True, page_size=1)
    with pytest.raises(ValidationError, match="HiSparse"):
        make_engine(enable_hisparse=True, tp_size=2)


def test_quest_picks_the_page_whose_keys_answer_the_query():
    """One page holds a key aligned with the query: its bound is the largest, so it is selected."""
    from types import SimpleNamespace

    from kvledger.config import HiSparseSettings
    from kvledger.memory.sparse_kv import SparseBegin, SparseStep
    from kvledger.model.hisparse import SparseWorker

    torch.manual_seed(0)
    layers, kvh, d, ps, n_pages = 1, 2, 8, 4, 12
    cfg = HiSparseSettings(enable_hisparse=True, hisparse_sink_pages=1, hisparse_recent_pages=2,
                           hisparse_top_k_pages=1, hisparse_hot_pages=5, hisparse_dense_layers=0)  # fmt: skip
    w = SparseWorker(cfg, 32, layers, kvh, d, ps, torch.float32)
    kv = SimpleNamespace(k=torch.randn(layers, kvh, 64 * ps, d) * 0.1, v=torch.randn(layers, kvh, 64 * ps, d))
    q = torch.randn(1, 2 * kvh, d)
    needle = {0: 6, 1: 3}  # per KV head, the page with the aligned key
    for h, page in needle.items():
        kv.k[0, h, page * ps + 1] = q[0, 2 * h] * 5
    kv_len = n_pages * ps - 1
    w.apply(SparseStep(begins=[SparseBegin(0, list(range(n_pages)), list(range(20)), [40, 41, 42, 43, 44], kv_len)]), kv)
    pages, counts, in_host = w.select(0, q, torch.zeros(1, kvh, d), torch.zeros(1, kvh, d), [0], [kv_len + 1], kv)
    st = w.slots[0]
    assert not in_host
    for h, page in needle.items():
        chosen = [int(st.slot_page[0, h, j]) for j in range(1, 5)]
        assert page in chosen, (h, chosen)
        # sink page 0, the needle, the recent page n-2; the current page is read from hot[0]
        assert pages[0, h, -1] == 40 and counts[0] == 4 * ps
    assert np.all(st.where[0][st.where[0] >= 0] >= 1)


def test_pd_decode_kv_lands_in_host_pages(make_engine):
    """On a PD decode server the KV prefill sends is written straight into the request's host pages
    (``req X [hisparse staging]`` until it is in; no KV-pool page holds it). A prompt whose start decode
    has cached mixes both at the first sparse step. fp32, every page selected: output equals a dense
    engine's. An abort while the KV is on its way frees everything."""
    from tests.engine.test_disagg import drive, free_port, room

    port = free_port()
    pre = make_engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                      disaggregation_bind_host="127.0.0.1")  # fmt: skip
    dec = make_engine(disaggregation_mode="decode", disaggregation_bootstrap_port=port, **ALL_PAGES)
    try:
        ps = prompts(3, (41, 130, 70), seed=3)
        shared = ps[1][:64] + [9, 8, 7] * 10  # starts like ps[1]: decode's cache will hold 64 tokens
        ps.append(shared)
        sp = {**SP, "max_new_tokens": 8}
        want = outputs(make_engine(), ps, sp)
        assert dec.generate(input_ids=ps[1], sampling_params=sp)["output_ids"] == want[1]  # served whole
        for i, p in enumerate(ps):
            pre.add_request(p, sp, rid=f"p{i}", disagg=room(port, 300 + i))
            dec.add_request(p, sp, rid=f"d{i}", disagg=room(port, 300 + i))
        dec.step()  # admitted: claims sent, nothing arrived yet
        held = {h.owner for h in dec.core.scheduler.holdings()}
        assert "req d0 [hisparse staging]" in held, held
        assert all(len(h.own_pages) == 0 for h in dec.core.scheduler.holdings()
                   if h.owner == "req d0 [waiting for kv]")  # fmt: skip
        res = drive([pre, dec], {id(pre): [f"p{i}" for i in range(4)], id(dec): [f"d{i}" for i in range(4)]})
        assert [res[f"d{i}"]["output_ids"] for i in range(4)] == want
        assert res["d3"]["meta_info"]["cached_tokens"] >= 64  # decode's own prefix hit, then the rest sent
        sparse = dec.memory()["hisparse"]
        assert sparse["requests_landed_in_host"] == 4
        # An abort while its KV is on its way (prefill never runs it).
        dec.add_request(ps[0], sp, rid="gone", disagg=room(port, 399))
        dec.step()
        dec.abort("gone")
        res = drive([dec], {id(dec): ["gone"]})
        assert res["gone"]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        for eng in (pre, dec):
            eng.core.disagg_connector.timeout_s = 0.2
            eng.run_until_idle()
            eng.core.disagg_connector.close()


def test_pd_decode_session_turns_go_sparse_with_their_kv_in_host_pages(make_engine):
    """A session on a PD decode server crosses the threshold: its later turns' KV, sent by prefill past
    what the session holds, lands in host pages and the turn decodes sparsely; the session keeps only
    the pages its page list holds (the KV that landed in host pages is recomputed by the next turn as
    prefill's). fp32, every page selected: each turn equals the same session on one dense engine; the
    books are clean after each turn and the close."""
    from tests.engine.test_disagg import TURNS, drive, free_port, room
    from tests.helpers import assert_idle_clean

    sp = {**SP, "max_new_tokens": 6}
    one = make_engine()
    sid = one.open_session()
    want = [one.generate(input_ids=t, sampling_params=sp, session_params={"id": sid})["output_ids"] for t in TURNS]
    port = free_port()
    pre = make_engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                      disaggregation_bind_host="127.0.0.1")  # fmt: skip
    dec = make_engine(disaggregation_mode="decode", disaggregation_bootstrap_port=port,
                      **{**ALL_PAGES, "hisparse_min_context": 40})  # fmt: skip
    try:
        sid = dec.open_session()
        for k, t in enumerate(TURNS):
            dec.add_request(t, sp, rid=f"d{k}", session_params={"id": sid}, disagg=room(port, 700 + k))
            pre.add_request(t, sp, rid=f"p{k}", session_params={"id": sid}, disagg=room(port, 700 + k))
            out = drive([pre, dec], {id(pre): [f"p{k}"], id(dec): [f"d{k}"]})[f"d{k}"]
            assert out["output_ids"] == want[k], k
            assert_idle_clean(dec)
        sparse = dec.memory()["hisparse"]
        assert sparse["requests_begun"] == 3 and sparse["requests_landed_in_host"] == 3  # turns 2-4: 47+ tokens
        dec.close_session(sid)
        assert_idle_clean(dec)
    finally:
        for eng in (pre, dec):
            eng.core.disagg_connector.timeout_s = 0.2
            eng.run_until_idle()
            eng.core.disagg_connector.close()


def test_a_failed_first_sparse_step_is_rerun_request_by_request(make_engine):
    """Fault isolation reruns a failed step one request at a time: each rerun applies only its own
    request's first sparse step (another slot's again would reset that slot after its own rerun and
    lose the token its forward backed up). fp32, every page selected: output stays dense's."""
    ps = prompts(3, (150, 150, 150), seed=5)
    dense = outputs(make_engine(), ps)
    eng = make_engine(**ALL_PAGES)
    core = eng.core
    inner = core.executor
    failed = []

    class FailOnce:
        def execute_model(self, sched):
            if not failed and sched.hisparse is not None and len(sched.hisparse.begins) > 1 and len(sched.reqs) > 1:
                failed.append(len(sched.hisparse.begins))
                raise RuntimeError("injected: a kernel failed in the first sparse step")
            return inner.execute_model(sched)

        def __getattr__(self, name):
            return getattr(inner, name)

    core.executor = FailOnce()
    assert outputs(eng, ps) == dense
    assert failed == [3]


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_one_call_decode_with_sparse_rows_equals_the_layer_loop(make_engine, monkeypatch, dense_layers):
    """bf16 + int4 on the cpu backend: a batch of decodes with HiSparse rows among them (2 of 4 prompts
    over the threshold) runs every layer in one C++ call, the sparse rows' pages chosen and read in
    place in the host pool; the same tokens and logprobs bit for bit as the Python layer loop (the
    same kernels per layer). ``dense_layers=1``: layer 0 reads every host page, layer 1 selects."""
    from kvledger import kernels
    from kvledger.model import causal_lm

    if not kernels.load():
        pytest.skip("the C++ kernels do not load here")
    sp = {**SP, "logprobs": True}
    runs = {}
    for one_call in (False, True):
        monkeypatch.setattr(causal_lm, "DECODE_IN_ONE_CALL", one_call)
        eng = make_engine(dtype="bfloat16", quantization="int4", attention_backend="cpu",
                          **{**SMALL, "hisparse_min_context": 200, "hisparse_dense_layers": dense_layers})  # fmt: skip
        res = eng.generate(input_ids=prompts(4), sampling_params=sp)
        runs[one_call] = [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in res]
        assert eng.memory()["hisparse"]["requests_begun"] == 2  # the 300- and 513-token prompts
        assert eng.core.runner.sparse.in_place_forwards > 0
        assert (eng.core.model.one_call_forwards > 0) == one_call
    assert runs[True] == runs[False]


def test_dense_layers_read_every_page_on_both_backends(make_engine):
    """``hisparse_dense_layers=1`` on the 2-layer model: layer 0 attends over every host page (the torch
    reference gathers them from the host pool, the cpu kernel reads them in place), layer 1 selects;
    both backends give the same tokens, and differ from all layers sparse."""
    ps = prompts(4)
    cfg = {**SMALL, "hisparse_dense_layers": 1}
    ref = outputs(make_engine(attention_backend="torch", **cfg), ps)
    assert outputs(make_engine(attention_backend="cpu", **cfg), ps) == ref
    assert outputs(make_engine(attention_backend="cpu", **SMALL), ps) != ref


def _conversation(turns, eng, sp, sid=None, rewind=None):
    """Each turn's output: as turns of session ``sid`` on ``eng``, or (``sid`` None) as full prompts
    holding the conversation so far. ``rewind``: (turn index, offset) sends that turn at ``offset``."""
    history: list[int] = []
    got = []
    for i, t in enumerate(turns):
        offset = rewind[1] if rewind and rewind[0] == i else len(history)
        if sid is None:
            out = eng.generate(input_ids=history[:offset] + t, sampling_params=sp)["output_ids"]
        else:
            sess = {"id": sid, "offset": offset}
            out = eng.generate(input_ids=t, sampling_params=sp, session_params=sess)["output_ids"]
        got.append(out)
        history = history[:offset] + t + out
    return got


@pytest.mark.parametrize("budget", ["all_pages", "small"])
def test_a_session_that_crosses_the_threshold_goes_sparse_and_stays_exact(make_engine, budget):
    """A conversation whose history crosses ``--hisparse-min-context`` across turns: its later turns
    decode sparsely (reading the host copy of the session's KV), one turn rewinds into the history,
    and each turn's tokens equal the same conversation sent as full prompts without a session: with
    every page selected that is dense attention's (fp32), with a small budget the same selection of
    the same KV (the non-session requests go sparse at the same turns). The books are clean after
    every turn (the session holds its prompt's pages, the turn's host and hot pages are back) and
    once the session closes."""
    from tests.helpers import assert_idle_clean

    rng = random.Random(7)
    turns = [[rng.randrange(3, 200) for _ in range(n)] for n in (60, 40, 50, 30, 25)]
    sp = {**SP, "max_new_tokens": 10}
    cfg = {**(ALL_PAGES if budget == "all_pages" else SMALL), "hisparse_min_context": 120}
    rewind = (4, 60 + 10 + 40 + 10 + 5)  # into the third turn's input: 125 + 25 >= 120, sparse again
    ref = make_engine(enable_prefix_cache=False, **cfg)
    want = _conversation(turns, ref, sp, rewind=rewind)
    assert ref.memory()["hisparse"]["requests_begun"] == 3  # turns 3, 4 and the rewound 5 pass 120 tokens
    if budget == "all_pages":
        assert want == _conversation(turns, make_engine(enable_prefix_cache=False), sp, rewind=rewind)
    eng = make_engine(**cfg)
    sid = eng.open_session()
    for i, (t, w) in enumerate(zip(turns, want)):
        offset = rewind[1] if i == rewind[0] else None
        sess = {"id": sid} if offset is None else {"id": sid, "offset": offset}
        assert eng.generate(input_ids=t, sampling_params=sp, session_params=sess)["output_ids"] == w, i
        assert_idle_clean(eng)
        assert eng.memory()["hisparse"]["host_held"] == 0
    assert eng.memory()["hisparse"]["requests_begun"] == 3  # the same turns went sparse in the session
    assert eng.memory()["kv_session"] > 0
    eng.close_session(sid)
    assert_idle_clean(eng)
    assert eng.memory()["kv_session"] == 0


@pytest.mark.parametrize("how", ["abort", "close"])
def test_a_sparse_session_turn_ended_mid_decode_leaves_the_session_clean(make_engine, how):
    """A sparse session turn aborted mid-decode leaves the session as it was (the next turn's tokens
    equal those of a conversation that never had the aborted turn); a close while the sparse turn
    decodes releases the session at the turn's finish. Books clean either way."""
    from tests.helpers import assert_idle_clean

    rng = random.Random(3)
    turns = [[rng.randrange(3, 200) for _ in range(n)] for n in (130, 30)]
    sp = {**SP, "max_new_tokens": 10}
    cfg = {**SMALL, "hisparse_min_context": 120}
    want = _conversation(turns, make_engine(enable_prefix_cache=False, **cfg), sp)
    eng = make_engine(**cfg)
    sid = eng.open_session()
    assert eng.generate(input_ids=turns[0], sampling_params=sp, session_params={"id": sid})["output_ids"] == want[0]
    s = eng.core.scheduler
    eng.add_request(input_ids=turns[1][:20], sampling_params={**sp, "max_new_tokens": 30}, rid="x",
                    session_params={"id": sid})  # fmt: skip
    step_until(eng, lambda: "x" in s.reqs and s.reqs["x"].sparse is not None and len(s.reqs["x"].output_ids) > 3)
    if how == "abort":
        eng.abort("x")
    else:
        eng.close_session(sid)
    eng.run_until_idle()
    assert eng.result("x")["meta_info"]["finish_reason"]["type"] == ("abort" if how == "abort" else "length")
    assert_idle_clean(eng)
    assert eng.memory()["hisparse"]["host_held"] == 0
    if how == "close":
        assert eng.memory()["kv_session"] == 0 and not eng.core.sessions.sessions
        return
    assert eng.generate(input_ids=turns[1], sampling_params=sp, session_params={"id": sid})["output_ids"] == want[1]
    assert eng.memory()["hisparse"]["requests_begun"] == 3
    eng.close_session(sid)
    assert_idle_clean(eng)


def test_sparse_rows_overlap_and_keep_their_tokens(make_engine):
    """``--enable-overlap-schedule`` with HiSparse: sparse decodes run in overlapped steps (a first
    sparse step's dense pages go back after that step's own result, not the one before it). The
    output stays dense attention's with every page selected (fp32), and with a small budget it equals
    the synchronous engine's, two slots reused by eight requests (a slot's sparse state dropped before
    its next request begins) and a session crossing the threshold included; the books are clean."""
    from tests.helpers import assert_idle_clean

    ps = prompts(3)
    dense = outputs(make_engine(disable_overlap_schedule=False), ps)
    eng = make_engine(disable_overlap_schedule=False, **ALL_PAGES)
    assert eng.core.overlap
    assert outputs(eng, ps) == dense
    assert eng.memory()["hisparse"]["requests_begun"] == 3
    assert eng.core.overlap_stats["overlapped"] > 20  # the decodes overlapped
    assert_idle_clean(eng)
    s = eng.core.scheduler
    eng.add_request(input_ids=ps[0], sampling_params=SP, rid="a")
    step_until(eng, lambda: "a" in s.reqs and s.reqs["a"].sparse is not None and s.reqs["a"].sparse.active)
    r = s.reqs["a"]
    # Its first sparse step is launched and not landed: the dense pages it copies are still its own.
    assert s.in_flight.holds(r) and r.pages
    eng.step()  # that step's result is in: they are given back
    assert r.sparse.active and not r.pages
    eng.run_until_idle()
    assert eng.result("a")["output_ids"] == dense[0]
    ps = prompts(8, (140, 260, 200, 330))
    sync = make_engine(max_running_requests=2, **SMALL)
    want = outputs(sync, ps)
    eng = make_engine(max_running_requests=2, disable_overlap_schedule=False, **SMALL)
    assert outputs(eng, ps) == want
    assert eng.core.overlap_stats["overlapped"] > 20
    assert_idle_clean(eng)
    rng = random.Random(7)
    turns = [[rng.randrange(3, 200) for _ in range(n)] for n in (60, 40, 50, 30)]
    sp = {**SP, "max_new_tokens": 10}
    cfg = {**SMALL, "hisparse_min_context": 120}
    want = _conversation(turns, make_engine(**cfg), sp)
    eng = make_engine(disable_overlap_schedule=False, **cfg)
    assert _conversation(turns, eng, sp, sid=eng.open_session()) == want
    assert eng.memory()["hisparse"]["requests_begun"] == 2
    assert_idle_clean(eng)
