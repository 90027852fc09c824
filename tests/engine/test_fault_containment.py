"""A fault while computing one request ends that request with a 500 through the release path; its
batch neighbours produce exactly what they would have."""

from __future__ import annotations

import time

import pytest

from kvledger import Engine
from kvledger.errors import ReleaseError
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


def test_shutdown_is_bounded_when_work_cannot_end(make_engine, monkeypatch, caplog):
    """An engine whose work can never end (here a connector that always has I/O in flight: a PD
    transfer whose peer is gone, or books a failed step left inconsistent) still shuts down: the drain
    gives up after its timeout with an error naming what was left, and the executor and connector are
    closed. It stepped forever before (the combination fuzz hung in teardown after a violation)."""
    eng = make_engine()
    eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})
    conn = eng.core.scheduler.connector
    monkeypatch.setattr(type(conn), "has_pending", property(lambda self: True))
    closed = []
    monkeypatch.setattr(eng.core.executor, "shutdown", lambda: closed.append("executor"))
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="kvledger.engine.core"):
        eng.shutdown(drain_timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert closed == ["executor"]
    assert any("work left after" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert eng.core.kv_manager.ledger.audit(count=False).ok  # nothing was held: the books still hold


# -- a component that fails while a request is released (issue 50, item 11) --------------------------------
def _raise_for(rid: str, calls: list[str]):
    """A release hook (a component with per-request state) that fails for ``rid``."""

    def hook(req) -> None:
        calls.append(req.rid)
        if req.rid == rid:
            raise RuntimeError(f"injected release hook fault for {rid}")

    return hook


def _books_balanced(eng) -> None:
    """Every page and slot accounted for, now (not only once idle): the audit, conservation, and each
    slot free or held by a request the scheduler knows."""
    kvm, s = eng.core.kv_manager, eng.core.scheduler
    assert kvm.ledger.audit(count=False).ok
    kvm.ledger.check_conservation()
    held = [r.slot for r in s.reqs.values() if r.slot is not None]
    assert kvm.slots.num_free + len(held) == kvm.slots.num_slots


def test_a_failing_release_hook_is_reported_after_a_complete_release(tiny_loaded):
    """Production mode: the failing hook is logged and counted; the request's release still runs every
    step (its slot and pages go back, its KV is cached), every other request finishes as it would have,
    and the books balance after every step."""
    prompts = [[3 + i] * (12 + 7 * i) for i in range(4)]
    ref = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, strict_memory=True)
    refs = [ref.generate(input_ids=p, sampling_params=G)["output_ids"] for p in prompts]
    eng = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, page_size=16)
    calls: list[str] = []
    eng.core.scheduler.release_hooks.insert(0, _raise_for("bad", calls))
    rids = [eng.add_request(p, G, rid="bad" if i == 1 else None) for i, p in enumerate(prompts)]
    while not eng.core.scheduler.idle:
        eng.step()
        _books_balanced(eng)
    assert sorted(calls) == sorted(rids)  # every release told the hook, the failing one included
    for i, rid in enumerate(rids):
        res = eng.result(rid)
        assert res["output_ids"] == refs[i] and res["meta_info"]["finish_reason"]["type"] == "length"
    m = eng.memory()
    assert m["leak_check"]["contained_errors"] == 1 and m["leak_check"]["violations"] == 0
    assert m["kv_cached_evictable"] > 0  # the failing request's KV was still committed to the cache
    assert_idle_clean(eng)
    assert_idle_clean(ref)


def test_strict_mode_raises_a_failing_release_hook_after_the_release(tiny_loaded):
    """Strict mode raises the hook's failure (``ReleaseError``), but only at the step's books check,
    after the request's release completed: its slot and pages are back at that moment, and the engine
    goes on with the others, whose outputs are those of an engine without the fault."""
    prompts = [[5 + i] * (20 + 5 * i) for i in range(3)]
    g = {**G, "max_new_tokens": 6}
    ref = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, strict_memory=True)
    refs = [ref.generate(input_ids=p, sampling_params={**g, "max_new_tokens": 6 + 6 * i})["output_ids"]
            for i, p in enumerate(prompts)]  # fmt: skip
    eng = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, page_size=16, strict_memory=True)
    eng.core.scheduler.release_hooks.append(_raise_for("bad", []))
    rids = [eng.add_request(p, {**g, "max_new_tokens": 6 + 6 * i}, rid="bad" if i == 0 else None)
            for i, p in enumerate(prompts)]  # fmt: skip
    with pytest.raises(ReleaseError, match="injected release hook fault for bad"):
        eng.run_until_idle()
    s = eng.core.scheduler
    assert "bad" not in s.reqs and all(r.rid != "bad" for r in s.running)
    _books_balanced(eng)  # the release completed before the raise
    eng.run_until_idle()  # the others continue
    for i, rid in enumerate(rids):
        assert eng.result(rid)["output_ids"] == refs[i]
    assert eng.memory()["leak_check"]["contained_errors"] == 1
    assert_idle_clean(eng)
    assert_idle_clean(ref)


@pytest.mark.parametrize("strict", [False, True])
def test_a_failing_tree_hook_does_not_leave_a_request_half_released(tiny_loaded, strict):
    """A component hook inside the memory release (the radix tree's ``_inserted``, where the hierarchical
    cache backs a new leaf up) that fails while a finished request's KV is committed: before, the
    exception left the step with the request's tail pages freed but its slot and prefix lock held (and
    the engine step failed). Now the tree keeps the leaf, the lock and slot go back, the failure is
    counted (and raised after the release in strict mode), and the next requests are served."""
    eng = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, page_size=16, strict_memory=strict)
    tree = eng.core.kv_manager.tree
    fired: list[int] = []

    def failing_inserted(node) -> None:
        if not fired:
            fired.append(node.id)
            raise RuntimeError("injected tree hook fault")

    tree._inserted = failing_inserted
    ids = [7] * 40
    a = eng.add_request(ids, G, rid="a")
    if strict:
        with pytest.raises(ReleaseError, match="injected tree hook fault"):
            eng.run_until_idle()
    eng.run_until_idle()
    assert fired and eng.result(a)["meta_info"]["finish_reason"]["type"] == "length"
    kvm = eng.core.kv_manager
    assert kvm.slots.num_free == kvm.slots.num_slots and tree.protected_pages == 0
    _books_balanced(eng)
    # The committed prefix is in the tree: the next request with it reuses it.
    b = eng.generate(input_ids=[*ids, 9], sampling_params=G)
    assert b["meta_info"]["cached_tokens"] >= 32
    assert eng.memory()["leak_check"]["contained_errors"] == 1
    assert_idle_clean(eng)
