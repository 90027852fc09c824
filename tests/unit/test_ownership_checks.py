"""Ownership checks are real checks (issue 50, item 13): each raises ``OwnershipError`` (a
``MemoryLedgerError``) before anything changes, also under ``python -O``, which drops ``assert``
statements. ``test_the_checks_fire_under_python_O`` runs this module again under ``python -O``; and no
``assert`` guards state anywhere in src/kvledger (those kept only narrow a type, and say so)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.common import SamplingParams
from kvledger.errors import MemoryLedgerError, OwnershipError
from kvledger.memory import KVManager, Session, request_holding
from kvledger.scheduler import Req

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kvledger"
KEPT = "# type narrowing only"  # the comment an assert that is kept carries


def _manager(strict: bool = True) -> tuple[KVManager, list[Req]]:
    reqs: list[Req] = []
    kv = KVManager(
        16, 4, num_slots=4, enable_prefix_cache=True, strict=strict, holdings=lambda: (request_holding(r) for r in reqs)
    )
    return kv, reqs


def _running(kv: KVManager, reqs: list[Req], rid: str, tokens: list[int]) -> Req:
    req = Req(rid=rid, input_ids=tokens, params=SamplingParams())
    if not (kv.admit(req) and kv.allocate(req, len(tokens) - req.kv_len)):
        raise RuntimeError("the test's pool is too small")
    req.kv_len = len(tokens)
    reqs.append(req)
    return req


def _snapshot(kv: KVManager) -> tuple:
    return kv.pages.free_list(), kv.slots.free_list(), kv.tree.evictable_pages, kv.tree.protected_pages


def test_admitting_a_request_that_holds_a_slot_is_refused():
    kv, reqs = _manager()
    req = _running(kv, reqs, "a", list(range(9)))
    before = _snapshot(kv)
    with pytest.raises(OwnershipError, match="req a is admitted while it holds slot"):
        kv.admit(req)  # a second slot would leak the first
    assert _snapshot(kv) == before
    assert kv.ledger.audit().ok


def test_truncating_into_borrowed_pages_is_refused():
    kv, reqs = _manager()
    first = _running(kv, reqs, "a", list(range(9)))
    kv.release(first, commit=True)
    reqs.remove(first)
    req = _running(kv, reqs, "b", [*range(9), 1, 2])  # borrows a's two cached pages
    assert req.num_tree_pages == 2
    before = _snapshot(kv)
    with pytest.raises(OwnershipError, match="borrowed or out-of-window pages"):
        kv.truncate(req, 4)  # would free a page the radix tree owns
    assert _snapshot(kv) == before and req.num_tree_pages == 2
    assert kv.ledger.audit().ok


def test_releasing_pages_without_a_slot_is_refused():
    kv, reqs = _manager()
    req = _running(kv, reqs, "a", list(range(6)))
    slot = req.slot
    req.slot = None  # a corruption: pages held without the slot that maps them
    with pytest.raises(OwnershipError, match="holds 2 page entries but no slot"):
        kv.release(req, commit=False)
    req.slot = slot
    kv.release(req, commit=False)
    reqs.remove(req)
    assert kv.ledger.audit().ok


def test_freeing_a_sessions_pages_while_a_turn_borrows_them_is_refused():
    kv, _reqs = _manager()
    s = kv.sessions.by_id["s1"] = Session(id="s1", timeout_s=None)
    s.pages = kv.pages.alloc(2, s.owner)
    s.kv_len = 8
    s.busy_rid = "turn"
    with pytest.raises(OwnershipError, match="while turn turn borrows them"):
        kv.sessions.free_pages(s)
    assert len(s.pages) == 2 and kv.pages.num_free == 14
    s.busy_rid = None
    kv.sessions.release(s)
    assert kv.pages.num_free == 16


def test_a_radix_insert_whose_pages_do_not_match_its_tokens_is_refused():
    kv, _reqs = _manager()
    pages = kv.pages.alloc(2, "x")
    with pytest.raises(OwnershipError, match="radix insert of 12 tokens with 2 pages"):
        kv.tree.insert(list(range(12)), pages)
    assert kv.tree.evictable_pages == 0
    kv.free(pages, "x")


def test_giving_back_an_id_outside_the_pool_is_refused():
    kv, _reqs = _manager()
    pages = kv.pages.alloc(1, "x")
    with pytest.raises(OwnershipError, match="outside the pool"):
        kv.free([-1], "x")  # would index the last page from the end, freeing it under its owner
    assert kv.pages.num_free == 15
    kv.free(pages, "x")


def test_a_double_free_raises_in_strict_mode():
    kv, _reqs = _manager()
    pages = kv.pages.alloc(2, "x")
    kv.free(pages, "x")
    with pytest.raises(MemoryLedgerError, match="double free of L1 pages"):
        kv.free(pages, "x")
    assert kv.pages.num_free == 16 and kv.double_frees == 2


def test_asserts_left_in_src_only_narrow_types():
    """Every ``assert`` in src/kvledger says on its line that it only narrows a type for the type
    checker (nothing would go wrong without it); any check of state is an ``if ...: raise``."""
    unmarked = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Assert) and KEPT not in lines[node.lineno - 1]:
                unmarked.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not unmarked, "asserts that python -O would drop:\n" + "\n".join(unmarked)


@pytest.mark.skipif(sys.flags.optimize > 0, reason="this is the run under python -O")
def test_the_checks_fire_under_python_O():
    """This module again, under ``python -O`` (asserts compiled out of src/kvledger): every check above
    still raises."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("KVLEDGER_CI_NO_SKIP", None)  # the run under -O skips this test itself: not a failure there
    r = subprocess.run(
        [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestConfigWarning",
         __file__],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
