"""The hierarchical cache (L2 host pages, L3 files) on the tiny Llama: exact output over a working set
larger than L1, restart warm from files, every named HiCache failure, the L2 books, and safety; the
same under tensor parallelism (every rank moves its heads; a load is all ranks or none) and with a
draft model (its K/V recomputed after a load, never stale).

Every engine is strict (a ledger violation raises at the step it happens) and is audited clean at
teardown (``make_engine``); the tests that hold file I/O in flight close the I/O thread's gate."""

from __future__ import annotations

import contextlib
import os
import random
import stat
import threading
from pathlib import Path

import pytest

from kvledger import Engine, ValidationError
from kvledger.errors import OverloadedError
from kvledger.hicache.storage import FileStorage, PageHasher, load_or_create_salt
from tests.helpers import assert_idle_clean, record_drafts
from tests.server_harness import process_alive

G = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PS = 4
L1 = 256  # tokens of KV pool: the workload below touches 4x that


def _workload(seed: int = 0, families: int = 8, prefix: int = 96, repeats: int = 2) -> list[list[int]]:
    """Shared-prefix families, each asked twice per round: 8 x 104 tokens ~ 4x L1."""
    rng = random.Random(seed)
    fams = [[rng.randrange(1, 250) for _ in range(prefix)] for _ in range(families)]
    return [f + [rng.randrange(1, 250) for _ in range(8)] for f in fams for _ in range(repeats)]


def _hier(make_engine, **kw):
    opts = dict(page_size=PS, max_total_tokens=L1, enable_hierarchical_cache=True, hicache_ratio=8)
    opts.update(kw)
    return make_engine(**opts)


def _run(eng, prompts, rounds: int = 2) -> list[list[int]]:
    return [
        eng.generate(input_ids=p, sampling_params=G)["output_ids"] for _ in range(rounds) for p in prompts
    ]


def _hc(eng) -> dict:
    return eng.memory()["hicache"]


@pytest.fixture
def baseline(make_engine):
    """Outputs of the same workload on an engine without the hierarchy (and L1 only)."""
    cache = {}

    def get(prompts):
        key = tuple(map(tuple, prompts))
        if key not in cache:
            cache[key] = _run(make_engine(page_size=PS, max_total_tokens=L1), prompts)
        return cache[key]

    return get


def _io(eng):
    return eng.core.kv_manager.tiers.io


@pytest.fixture(autouse=True)
def _open_gates(make_engine, monkeypatch):
    """A test that fails with a gate closed must not hang the teardown audit (which waits for
    idle): every I/O thread's gate opens before the engines are audited."""
    from kvledger.hicache import io

    made = []
    orig = io.StorageIO.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(io.StorageIO, "__init__", init)
    yield
    for x in made:
        x.gate.set()


# -- exactness and hits --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_outputs_equal_without_the_hierarchy_at_4x_l1(make_engine, baseline, policy):
    prompts = _workload()
    eng = _hier(make_engine, hicache_write_policy=policy)
    assert _run(eng, prompts) == baseline(prompts)
    h = _hc(eng)
    assert h["l2_hit_tokens"] > 0 and h["l1_demoted_pages"] > 0, h
    assert h["backed_up_pages"] > 0, h
    assert_idle_clean(eng)


def test_load_back_is_reported_as_cached_tokens(make_engine):
    eng = _hier(make_engine)
    p = _workload(families=1, repeats=1)[0]
    first = eng.generate(input_ids=p, sampling_params=G)
    # Push it out of L1 with other prompts (its copy stays in L2).
    _run(eng, _workload(seed=1), rounds=1)
    again = eng.generate(input_ids=p, sampling_params=G)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 96, again["meta_info"]
    assert _hc(eng)["l2_hit_tokens"] >= 96


def test_small_l2_matches_are_recomputed(make_engine):
    eng = _hier(make_engine, hicache_load_back_threshold=10_000)
    _run(eng, _workload())
    h = _hc(eng)
    assert h["l2_hit_tokens"] == 0 and h["loads_skipped_small"] > 0, h


def test_l2_smaller_than_the_working_set_evicts_l2(make_engine, baseline):
    prompts = _workload()
    eng = _hier(make_engine, hicache_ratio=1.5)
    assert _run(eng, prompts) == baseline(prompts)
    assert _hc(eng)["l2_evicted_pages"] > 0


# -- L3: restart warm ------------------------------------------------------------------------------------
def test_restart_on_the_same_storage_dir_starts_warm(make_engine, baseline, tmp_path):
    prompts = _workload()
    d = str(tmp_path / "l3")
    first = _hier(make_engine, hicache_ratio=2, hicache_storage_backend="file", hicache_storage_dir=d)
    assert _run(first, prompts) == baseline(prompts)
    assert_idle_clean(first)  # idle: every store has reported
    assert _hc(first)["l3_files"] > 0
    first.shutdown()
    second = _hier(make_engine, hicache_ratio=2, hicache_storage_backend="file", hicache_storage_dir=d)
    out = second.generate(input_ids=prompts[0], sampling_params=G)
    assert out["output_ids"] == baseline(prompts)[0]
    assert out["meta_info"]["cached_tokens"] >= 96, out["meta_info"]
    assert _hc(second)["l3_hit_tokens"] >= 96
    assert _run(second, prompts) == baseline(prompts)


def _written(make_engine, tmp_path, prompt, **kw):
    d = str(tmp_path / "l3")
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d, **kw)
    out = eng.generate(input_ids=prompt, sampling_params=G)["output_ids"]
    assert_idle_clean(eng)
    eng.shutdown()
    return d, out


def _keys(eng, prompt):
    t = eng.core.kv_manager.tiers
    return t.hasher.chain(prompt[: len(prompt) - 1])


# -- named failures --------------------------------------------------------------------------------------
def test_abort_during_an_l3_prefetch(make_engine, tmp_path):
    prompt = _workload(families=1, repeats=1)[0]
    d, want = _written(make_engine, tmp_path, prompt)
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d)
    _io(eng).gate.clear()
    rid = eng.add_request(prompt, G)
    eng.step()
    h = _hc(eng)
    assert h["prefetches"] == 1 and h["l2_prefetching"] >= 96, h
    assert eng.core.scheduler.waiting, "the request waits for its prefetch"
    report = eng.audit()
    assert report.ok, report.describe()
    eng.abort(rid)
    eng.step()
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    # The read is still in flight: its pages are the prefetch's, named as cancelled.
    assert _hc(eng)["l2_prefetching"] >= 96 and not eng.core.scheduler.idle
    owners = set(eng.core.kv_manager.tiers.host.last_owner)
    assert any("prefetch for req" in o for o in owners)
    _io(eng).gate.set()
    eng.run_until_idle()
    h = _hc(eng)
    assert h["l2_prefetching"] == 0 and h["prefetches_cancelled"] == 1, h
    assert_idle_clean(eng)
    # What was read is good KV: the next request for the prompt uses it.
    again = eng.generate(input_ids=prompt, sampling_params=G)
    assert again["output_ids"] == want and again["meta_info"]["cached_tokens"] >= 96


def test_abort_during_a_load_back(make_engine, baseline):
    prompts = _workload()
    eng = _hier(make_engine)
    _run(eng, prompts, rounds=1)  # the first families are now in L2 only
    conn = eng.core.connector
    seen = []
    orig = conn.wait_for_layer_load

    def abort_mid_load(layer):
        if layer == 1 and conn._worker_loads and not seen:
            seen.append(conn._worker_loads[0].rid)
            eng.core.abort(seen[0], "aborted during its load-back")
        orig(layer)

    conn.wait_for_layer_load = abort_mid_load
    rid = eng.add_request(prompts[0], G)
    eng.run_until_idle()
    assert seen == [rid]
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    assert all(p == 0 for p in eng.core.kv_manager.tiers.host.pins)
    assert_idle_clean(eng)
    conn.wait_for_layer_load = orig
    assert _run(eng, prompts) == baseline(prompts)  # nothing it loaded or cached is wrong


def test_eviction_of_a_node_that_a_load_is_filling(make_engine, baseline):
    prompts = _workload()
    eng = _hier(make_engine)
    _run(eng, prompts, rounds=1)
    conn = eng.core.connector
    tiers = eng.core.kv_manager.tiers
    checked = []
    orig = conn.wait_for_layer_load

    def evict_everything(layer):
        if layer == 0 and conn._worker_loads:
            load = conn._worker_loads[0]
            tree = eng.core.kv_manager.tree
            tree.evict_host(10**6)
            tree.evict(10**6)
            # The L2 pages the load reads are pinned: still the tree's, not freed or reused.
            assert all(tiers.host.pins[p] > 0 for p in load.host_pages)
            assert all(not tiers.host.is_free(p) for p in load.host_pages)
            checked.append(load.rid)
        orig(layer)

    conn.wait_for_layer_load = evict_everything
    out = eng.generate(input_ids=prompts[0], sampling_params=G)
    conn.wait_for_layer_load = orig
    assert checked and out["output_ids"] == baseline(prompts)[0]
    assert_idle_clean(eng)


def test_queue_limit_refusal_after_a_prefetch_started(make_engine, tmp_path):
    fams = _workload(families=2, repeats=1)
    d, _ = _written(make_engine, tmp_path, fams[0])
    _written(make_engine, tmp_path, fams[1])
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d, max_queued_requests=1)
    _io(eng).gate.clear()
    a = eng.add_request(fams[0], G)
    eng.step()
    assert _hc(eng)["prefetches"] == 1
    with pytest.raises(OverloadedError):
        eng.add_request(fams[1], G)  # refused before anything starts: no second prefetch
    h = _hc(eng)
    assert h["prefetches"] == 1 and h["l2_prefetching"] == (len(fams[0]) - 1) // PS * PS, h
    report = eng.audit()
    assert report.ok, report.describe()
    eng.abort(a)  # the queued request holding the prefetch goes: its pages follow when the read stops
    eng.step()
    _io(eng).gate.set()
    eng.run_until_idle()
    assert _hc(eng)["l2_prefetching"] == 0
    assert_idle_clean(eng)


def test_abort_while_a_write_back_is_in_flight(make_engine, tmp_path):
    prompts = _workload(families=2, repeats=2)
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"))
    _io(eng).gate.clear()
    eng.generate(input_ids=prompts[0], sampling_params=G)  # its KV is cached, backed up, being stored
    assert _hc(eng)["l2_storing"] > 0 and not eng.core.scheduler.idle
    rid = eng.add_request(prompts[1], {**G, "max_new_tokens": 50})  # reads the node being stored
    for _ in range(3):
        eng.step()
    eng.abort(rid)
    for _ in range(2):
        eng.step()
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    assert _hc(eng)["l2_storing"] > 0
    report = eng.audit()
    assert report.ok, report.describe()
    # Eviction pressure while stores run: pinned pages stay.
    eng.core.kv_manager.tree.evict(10**6)
    eng.core.kv_manager.tree.evict_host(10**6)
    assert _hc(eng)["l2_storing"] > 0
    _io(eng).gate.set()
    eng.run_until_idle()
    h = _hc(eng)
    assert h["l2_storing"] == 0 and h["pages_written"] > 0, h
    assert_idle_clean(eng)


def test_flush_cache_during_loads(make_engine, tmp_path):
    prompt = _workload(families=1, repeats=1)[0]
    d, _ = _written(make_engine, tmp_path, prompt)
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d)
    _run(eng, _workload(seed=3, families=2), rounds=1)  # stores of its own
    _io(eng).gate.clear()
    rid = eng.add_request(prompt, G)
    eng.step()
    assert _hc(eng)["l2_prefetching"] > 0
    assert not eng.flush_cache()  # a request is queued: refused, nothing dropped
    eng.abort(rid)
    eng.step()
    assert eng.result(rid) is not None
    # No request left, the read still in flight: flush waits for it, then drops L1 and L2.
    threading.Timer(0.3, _io(eng).gate.set).start()
    assert eng.flush_cache()
    m, h = eng.memory(), _hc(eng)
    assert m["kv_free"] == m["kv_total"] and h["l2_free"] == h["l2_total"], h
    assert h["l3_files"] > 0  # the file tier is the persistent one: flush keeps it
    assert_idle_clean(eng)


# -- L3 safety -----------------------------------------------------------------------------------------
def _tamper(path: str, how: str) -> None:
    data = Path(path).read_bytes()
    if how == "corrupt":
        data = data[:-10] + bytes(b ^ 0xFF for b in data[-10:])
    elif how == "truncated":
        data = data[: len(data) // 2]
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
def test_a_bad_l3_file_is_a_miss_never_loaded(make_engine, tmp_path, how):
    prompt = _workload(families=1, repeats=1)[0]
    d, want = _written(make_engine, tmp_path, prompt)
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d)
    t = eng.core.kv_manager.tiers
    keys = _keys(eng, prompt)
    bad = 10  # page 10 of 25: the prefetch stops there
    path = t.storage.path(keys[bad])
    if how == "foreign":  # a well-formed file under the right name, of another deployment's KV
        payload = Path(path).read_bytes()[-t.storage.page_bytes :]
        FileStorage(d, "another model|float32|...", t.storage.page_bytes).set(keys[bad], payload)
    else:
        _tamper(path, how)
    out = eng.generate(input_ids=prompt, sampling_params=G)
    assert out["output_ids"] == want
    assert out["meta_info"]["cached_tokens"] == bad * PS, out["meta_info"]
    h = _hc(eng)
    assert h["rejected"] == {how: 1}, h
    assert_idle_clean(eng)
    # The bad file was removed; the request's own backup wrote the page again, and it reads back.
    assert t.storage.get(keys[bad], t.mover.host.page_view(0).clone()) and h["rejected"] == {how: 1}


def test_storage_dir_is_private_and_keys_are_salted(make_engine, tmp_path):
    d = tmp_path / "l3"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    prompt = _workload(families=1, repeats=1)[0]
    _written(make_engine, tmp_path, prompt, hicache_salt="tenant-a")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".kv")]
    assert files and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    other = _hier(
        make_engine, hicache_storage_backend="file", hicache_storage_dir=str(d), hicache_salt="tenant-b"
    )
    out = other.generate(input_ids=prompt, sampling_params=G)
    assert out["meta_info"]["cached_tokens"] == 0 and _hc(other)["l3_hit_tokens"] == 0
    same = _hier(
        make_engine, hicache_storage_backend="file", hicache_storage_dir=str(d), hicache_salt="tenant-a"
    )
    assert same.generate(input_ids=prompt, sampling_params=G)["meta_info"]["cached_tokens"] > 0


def test_a_request_cache_salt_separates_the_files_too(make_engine, tmp_path):
    """A request's cache_salt is in its page keys: another salt (or none) never reads its files."""
    prompt = _workload(families=1, repeats=1)[0]
    d = str(tmp_path / "l3")
    first = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d)
    want = first.generate(input_ids=prompt, sampling_params={**G, "cache_salt": "a"})["output_ids"]
    assert_idle_clean(first)
    assert _hc(first)["l3_files"] > 0
    first.shutdown()
    for salt, hit in ((None, False), ("b", False), ("a", True)):
        eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d)
        out = eng.generate(input_ids=prompt, sampling_params={**G, "cache_salt": salt})
        assert (out["meta_info"]["cached_tokens"] > 0, _hc(eng)["l3_hit_tokens"] > 0) == (hit, hit), salt
        assert out["output_ids"] == want
        assert_idle_clean(eng)
        eng.shutdown()


def test_without_a_salt_one_is_kept_in_the_dir(make_engine, tmp_path):
    prompt = _workload(families=1, repeats=1)[0]
    d, _ = _written(make_engine, tmp_path, prompt)
    salt = os.path.join(d, "salt")
    assert os.path.getsize(salt) == 32 and stat.S_IMODE(os.stat(salt).st_mode) == 0o600
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d)
    assert eng.generate(input_ids=prompt, sampling_params=G)["meta_info"]["cached_tokens"] > 0


# -- sessions -----------------------------------------------------------------------------------------
def test_idle_session_is_demoted_to_l2_and_loaded_back(make_engine):
    rng = random.Random(7)
    turns = [[rng.randrange(3, 250) for _ in range(60)] for _ in range(3)]
    ref = make_engine(page_size=PS, enable_prefix_cache=False)
    history, refs = [], []
    for t in turns:
        o = ref.generate(input_ids=history + t, sampling_params=G)["output_ids"]
        refs.append(o)
        history += t + o
    eng = _hier(make_engine)
    sid = eng.open_session()
    for i, t in enumerate(turns):
        out = eng.generate(input_ids=t, sampling_params=G, session_params={"id": sid})
        assert out["output_ids"] == refs[i], i
        # A prompt nearly as big as L1 while the session is idle: the cache alone cannot make room.
        eng.generate(input_ids=[rng.randrange(3, 250) for _ in range(L1 - 24)], sampling_params=G)
        h = _hc(eng)
        assert h["session_demotions"] == i + 1 and h["l2_session"] > 0, h
        assert eng.memory()["kv_session"] == 0
        assert_idle_clean(eng)
    h = _hc(eng)
    assert h["session_promotions"] == 2 and h["session_drops"] == 0, h
    eng.close_session(sid)
    assert _hc(eng)["l2_session"] == 0


# -- the books ---------------------------------------------------------------------------------------
def test_the_books_catch_an_l2_leak_and_production_reclaims(make_engine, tiny_loaded):
    from kvledger import Engine
    from kvledger.errors import MemoryLedgerError

    # Built here, not by make_engine: its teardown wants no violation ever counted.
    eng = Engine(
        loaded_model=tiny_loaded, dtype="float32", page_size=PS, max_total_tokens=L1,
        enable_hierarchical_cache=True, hicache_ratio=8,
    )  # fmt: skip
    _run(eng, _workload(families=2), rounds=1)
    host = eng.core.kv_manager.tiers.host
    lost = host.alloc(3, "a buggy component")  # taken and never booked
    report = eng.core.kv_manager.ledger.audit(count=False)
    assert set(report.leaked_host_pages) == set(lost), report.describe()
    assert "a buggy component" in report.describe()
    eng.audit()  # production: counted, reclaimed, serving on
    assert all(host.is_free(p) for p in lost)
    assert eng.audit().ok
    eng.core.kv_manager.ledger.strict = True
    host.alloc(1, "a buggy component")
    with pytest.raises(MemoryLedgerError, match="L2 conservation"):
        eng.core.kv_manager.ledger.check_conservation()


def test_server_info_memory_has_the_tiers(make_engine, tmp_path):
    eng = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "d"))
    _run(eng, _workload(families=2), rounds=1)
    eng.run_until_idle()
    h = _hc(eng)
    for k in ("l2_total", "l2_free", "l2_cached", "l2_loading", "l2_storing", "l2_prefetching", "l2_session"):
        assert k in h
    assert h["l2_free"] + h["l2_cached"] + h["l2_prefetching"] + h["l2_session"] == h["l2_total"]
    assert h["l3_files"] == h["pages_written"] > 0


# -- tensor parallel: every rank moves its heads of the same pages --------------------------------
class _TPEngines:
    """TP=2 engines over the tiny Llama's 2 KV heads (one per rank), L2 of 2 x L1 (so L2 evicts and
    L3 serves), strict books (conservation of L1 and L2 checked at every step, on rank 0). Each is
    shut down at teardown even after a failure: the next one needs the process group."""

    def __init__(self, model: str):
        self.model = model
        self.live: list[Engine] = []

    def start(self, d: str, **kw) -> Engine:
        opts = dict(
            model=self.model, tp_size=2, dtype="float32", page_size=PS, max_total_tokens=L1, strict_memory=True,
            enable_hierarchical_cache=True, hicache_ratio=2, hicache_storage_backend="file", hicache_storage_dir=d,
        )  # fmt: skip
        opts.update(kw)
        self.live.append(Engine(**opts))
        return self.live[-1]

    def shut(self, eng: Engine) -> None:
        """Shut ``eng`` down; no rank may be left behind."""
        pids = eng.core.info.tp_worker_pids
        assert pids
        self.live.remove(eng)
        eng.shutdown()
        assert not any(process_alive(p) for p in pids), "a tensor-parallel rank was left behind"


@pytest.fixture
def tp_engines(tiny_llama):
    engines = _TPEngines(tiny_llama)
    yield engines
    for eng in engines.live:  # the test has failed: free the process group for the next one
        with contextlib.suppress(Exception):
            eng.shutdown()


def _rank_keys(eng: Engine, d: str, rank: int, prompt: list[int]) -> tuple[list[bytes], FileStorage]:
    """Rank ``rank``'s L3 keys of ``prompt``'s pages and its view of the files (its namespace)."""
    t = eng.core.kv_manager.tiers
    ns = t.hasher.namespace.replace("|tp0/2|", f"|tp{rank}/2|")
    assert ns != t.hasher.namespace or rank == 0
    hasher = PageHasher(load_or_create_salt(d), ns, PS)
    return hasher.chain(prompt[: len(prompt) - 1]), FileStorage(d, ns, t.storage.page_bytes)


def _session_refs(make_engine, turns: list[list[int]]) -> list[list[int]]:
    ref = make_engine(page_size=PS, enable_prefix_cache=False)
    history, refs = [], []
    for t in turns:
        refs.append(ref.generate(input_ids=history + t, sampling_params=G)["output_ids"])
        history += t + refs[-1]
    return refs


def test_tp2_hierarchy_equals_the_plain_engine(make_engine, baseline, tp_engines, tmp_path):
    """Load-backs from L2, prefetches from L3, a session demoted to L2 and promoted, and a restart
    warm from the files, all under TP=2: every rank must have saved, stored, read and loaded its own
    heads for the output to equal the plain engine's. The full audit runs after every step of the
    first round; no rank is left behind."""
    prompts = _workload()
    want = baseline(prompts)
    rng = random.Random(7)
    turns = [[rng.randrange(3, 250) for _ in range(60)] for _ in range(2)]
    refs = _session_refs(make_engine, turns)
    d = str(tmp_path / "l3")
    eng = tp_engines.start(d)
    out = []
    for p in prompts:  # round one, audited at every step
        rid = eng.add_request(p, G)
        while (r := eng.result(rid)) is None:
            eng.step()
            report = eng.audit()
            assert report.ok, report.describe()
        out.append(r["output_ids"])
    out += [eng.generate(input_ids=p, sampling_params=G)["output_ids"] for p in prompts]
    assert out == want
    sid = eng.open_session()
    for i, t in enumerate(turns):
        got = eng.generate(input_ids=t, sampling_params=G, session_params={"id": sid})
        assert got["output_ids"] == refs[i], i
        eng.generate(input_ids=[rng.randrange(3, 250) for _ in range(L1 - 24)], sampling_params=G)
    eng.close_session(sid)
    h = _hc(eng)
    assert h["l2_hit_tokens"] > 0 and h["l3_hit_tokens"] > 0 and h["l2_evicted_pages"] > 0, h
    assert h["session_demotions"] == 2 and h["session_promotions"] == 1, h
    assert h["prefetch_pages_short"] == 0 and h["rejected"] == {}, h
    assert_idle_clean(eng)
    keys1, files1 = _rank_keys(eng, d, 1, prompts[0])
    assert files1.batch_exists(keys1) == len(keys1)  # rank 1 wrote its own files of the prompt
    tp_engines.shut(eng)
    again = tp_engines.start(d)
    got = again.generate(input_ids=prompts[0], sampling_params=G)
    assert got["output_ids"] == want[0]
    assert got["meta_info"]["cached_tokens"] >= 96 and _hc(again)["l3_hit_tokens"] >= 96, got["meta_info"]
    assert again.flush_cache()  # waits for every rank's file ops, then drops L1 and L2
    assert _hc(again)["l2_free"] == _hc(again)["l2_total"]
    assert_idle_clean(again)
    tp_engines.shut(again)


def test_tp2_a_bad_file_on_one_rank_is_a_miss_on_every_rank(baseline, tp_engines, tmp_path):
    """Rank 1's file of page 10 is corrupt; rank 0's files are whole: the prefetch takes the pages
    every rank read (10), not rank 0's 25, and the output is still the plain engine's."""
    prompt = _workload(families=1, repeats=1)[0]
    want = baseline([prompt])[0]
    d = str(tmp_path / "l3")
    first = tp_engines.start(d)
    assert first.generate(input_ids=prompt, sampling_params=G)["output_ids"] == want
    assert_idle_clean(first)
    keys, files1 = _rank_keys(first, d, 1, prompt)
    keys0, files0 = _rank_keys(first, d, 0, prompt)
    assert files0.batch_exists(keys0) == files1.batch_exists(keys) == len(keys) == 25
    tp_engines.shut(first)
    bad = 10
    _tamper(files1.path(keys[bad]), "corrupt")
    eng = tp_engines.start(d)
    out = eng.generate(input_ids=prompt, sampling_params=G)
    assert out["output_ids"] == want
    assert out["meta_info"]["cached_tokens"] == bad * PS, out["meta_info"]
    h = _hc(eng)
    assert h["l3_hit_tokens"] == bad * PS and h["prefetch_pages_short"] == 25 - bad, h
    assert h["rejected"] == {}, h  # rank 0's own files were whole
    assert_idle_clean(eng)
    # Rank 1 removed the bad file; the request's backup stored the page again, and it reads back.
    assert files1.get(keys[bad], eng.core.kv_manager.tiers.mover.host.page_view(0).clone())
    tp_engines.shut(eng)


# -- a draft model: its K/V is recomputed, never moved ----------------------------------------------

def test_draft_model_with_the_hierarchy(make_engine, baseline, tiny_llama, tmp_path):
    """Pages loaded back from L2 and L3 carry no draft K/V (they are fresh L1 pages); the draft
    recomputes a request's sequence from position 0 after its admission, so its drafts equal those
    of a draft engine that caches nothing, draft for draft, and the output is the plain engine's."""
    prompts = _workload()
    draft = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_llama)
    ref = make_engine(page_size=PS, max_total_tokens=L1, enable_prefix_cache=False, **draft)
    d = str(tmp_path / "l3")
    eng = _hier(make_engine, hicache_ratio=2, hicache_storage_backend="file", hicache_storage_dir=d, **draft)
    ref_drafts, drafts = record_drafts(ref), record_drafts(eng)
    assert _run(eng, prompts) == baseline(prompts) == _run(ref, prompts)
    assert drafts == ref_drafts and len(drafts) >= 2 * len(prompts)  # every request drafted
    h = _hc(eng)
    assert h["l2_hit_tokens"] > 0 and h["l3_hit_tokens"] > 0, h
    t = eng.core.scheduler.spec_totals
    assert t.accepted > 0.9 * t.drafted  # the target is its own draft: right draft K/V agrees
    assert_idle_clean(eng)
    eng.shutdown()
    again = _hier(make_engine, hicache_storage_backend="file", hicache_storage_dir=d, **draft)
    again_drafts = record_drafts(again)
    got = again.generate(input_ids=prompts[0], sampling_params=G)
    assert got["output_ids"] == baseline(prompts)[0] and got["meta_info"]["cached_tokens"] >= 96
    assert again_drafts == ref_drafts[: len(again_drafts)]


# -- settings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"hicache_write_policy": "sometimes"}, "write_policy"),
        ({"hicache_ratio": 0}, "hicache_ratio"),
        ({"hicache_storage_backend": "mooncake"}, "storage_backend"),
        ({"hicache_storage_backend": "file"}, "storage-dir"),
        ({"enable_prefix_cache": False}, "prefix cache"),
    ],
)
def test_bad_settings_are_refused(make_engine, kw, match):
    with pytest.raises(ValidationError, match=match):
        _hier(make_engine, **kw)


def test_storage_needs_the_hierarchy(make_engine, tmp_path):
    with pytest.raises(ValidationError, match="enable-hierarchical-cache"):
        make_engine(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))


def test_a_matched_l2_copy_survives_the_eviction_its_own_admission_causes(make_engine):
    """Found by the combination fuzz: under write_back with L1 and L2 full, admitting a request that
    loads its prefix back from L2 allocates its L1 pages, which evicts an L1-only node, whose backup
    needs L2 room, which evicted the very L2 copy just matched for the load (not pinned until the
    allocation was done): the load then read another prefix's KV and the output was wrong. The match
    is pinned from the moment it is made."""
    kw = dict(page_size=4, max_total_tokens=64, hicache_ratio=1.0, hicache_write_policy="write_back",
              hicache_load_back_threshold=0)  # fmt: skip
    eng = _hier(make_engine, **kw)
    ref = make_engine(page_size=4, max_total_tokens=256, enable_prefix_cache=False)
    a, b = list(range(10, 50)), list(range(100, 140))  # 10 pages each; L1 and L2 hold 16
    sp = {**G, "max_new_tokens": 1}
    want = ref.generate(input_ids=a, sampling_params=sp)["output_ids"]
    assert eng.generate(input_ids=a, sampling_params=sp)["output_ids"] == want
    eng.generate(input_ids=b, sampling_params=sp)  # evicts a's node from L1: its copy goes to L2
    loads = _hc(eng)["l2_hit_tokens"]
    # a again: its L2 copy is matched; its pages evict b's node, whose copy needs L2 room.
    assert eng.generate(input_ids=a, sampling_params=sp)["output_ids"] == want
    assert _hc(eng)["l2_hit_tokens"] > loads  # it was loaded back, not recomputed
