"""PD disaggregation x tensor parallel: prefill and decode engines with their own ``--tp-size`` (1/2,
2/1; 2/2 in tests/integration/test_pd_tp_router.py) on a tiny Llama with 4 KV heads (split over the
ranks) and one with 1 (replicated on each), talking over the built-in transport on 127.0.0.1. The wire
carries every head (rank 0 joins the ranks' heads on prefill, every rank places its own on decode),
so fp32 greedy output equals one plain engine's token for token -- which it cannot unless every
rank's heads were moved; with the hierarchical cache on both sides too. Aborts on decode while KV is in flight (waiting, staged on rank 0, collected
on prefill) leave both sides' books clean and nothing staged."""

from __future__ import annotations

import random
import time

import pytest

from kvledger import Engine
from kvledger.disagg.mooncake import available as mooncake_missing
from kvledger.disagg.tp import heads_of
from tests.engine.test_disagg import drive, free_port, owners, room, until_idle
from tests.helpers import assert_idle_clean, build_tiny_model
from tests.server_harness import process_alive

G = {"temperature": 0, "ignore_eos": True}
OPTS = dict(dtype="float32", max_total_tokens=512, chunked_prefill_size=32, strict_memory=True)
PROMPTS = [[5], list(range(3, 8)), list(range(20, 57)), [(7 * i) % 250 + 1 for i in range(70)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, str]:
    """KV heads -> a tiny Llama of 4 query heads: 4 KV heads split over 2 ranks, or 1 replicated."""
    return {
        kv: build_tiny_model(str(tmp_path_factory.mktemp(f"kv{kv}")), "llama", seed=3, num_key_value_heads=kv)
        for kv in (4, 1)
    }


def test_heads_of_splits_like_the_weights():
    """Which of the model's KV heads each rank holds (``shard_weights``), and which rank sends a
    replicated head: every head exactly once."""
    assert [heads_of(4, r, 2) for r in range(2)] == [(slice(0, 2), True), (slice(2, 4), True)]
    assert [heads_of(1, r, 2) for r in range(2)] == [(slice(0, 1), True), (slice(0, 1), False)]
    assert [heads_of(2, r, 4) for r in range(4)] == [
        (slice(0, 1), True), (slice(0, 1), False), (slice(1, 2), True), (slice(1, 2), False)
    ]  # fmt: skip


class Pair:
    """A prefill and a decode engine of the given TP sizes. One process holds one TP group, so a
    TP-2 prefill and a TP-2 decode cannot share it: 2/2 runs as servers behind the router
    (tests/integration/test_pd_tp_router.py)."""

    def __init__(self, model: str, tp_pre: int, tp_dec: int, backend: str = "tcp", tiers: bool = False):
        self.model, self.tiers = model, tiers
        self.port = free_port()
        both = dict(OPTS, disaggregation_transfer_backend=backend)
        if tiers:  # pools of a quarter of test_pd_with_tp_and_tiers' workload
            both.update(max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=8)
        self.pre = Engine(model=model, tp_size=tp_pre, page_size=16, disaggregation_mode="prefill",
                          disaggregation_bootstrap_port=self.port, disaggregation_bind_host="127.0.0.1",
                          **both)  # fmt: skip
        self.dec = Engine(model=model, tp_size=tp_dec, page_size=4, disaggregation_mode="decode",
                          disaggregation_prefill_peers=[f"127.0.0.1:{self.port}"], **both)  # fmt: skip
        self.sizes = (tp_pre, tp_dec)
        self.rooms = 0

    def run(self, prompts: list[list[int]], sp: dict) -> list[dict]:
        pre, dec = self.pre, self.dec
        rids = []
        for p in prompts:
            n = self.rooms = self.rooms + 1
            pre.add_request(p, sp, rid=f"p{n}", disagg=room(self.port, n))
            dec.add_request(p, sp, rid=f"d{n}", disagg=room(self.port, n))
            rids.append(n)
        res = drive([pre, dec], {id(pre): [f"p{n}" for n in rids], id(dec): [f"d{n}" for n in rids]})
        return [res[f"d{n}"] for n in rids]


# Mooncake on both: the TP side falls back to KV frames through rank 0, its peer (Mooncake, TP 1)
# meets it there -- a decode side that claimed with a Mooncake target, or a prefill side that gets a
# claim without one.
MOONCAKE = pytest.mark.skipif(bool(mooncake_missing()), reason=str(mooncake_missing()))


@pytest.fixture(
    scope="module",
    params=[(1, 2, "tcp", 4, False), (2, 1, "tcp", 4, False), (1, 2, "tcp", 1, False), (2, 1, "tcp", 1, False),
            (1, 2, "tcp", 4, True), (2, 1, "tcp", 4, True),
            pytest.param((1, 2, "mooncake", 4, False), marks=MOONCAKE),
            pytest.param((2, 1, "mooncake", 4, False), marks=MOONCAKE)],
    ids=["prefill1-decode2", "prefill2-decode1", "prefill1-decode2-kv1", "prefill2-decode1-kv1",
         "prefill1-decode2-tiers", "prefill2-decode1-tiers", "prefill1-decode2-mooncake", "prefill2-decode1-mooncake"],
)  # fmt: skip
def pair(request, models):
    tp_pre, tp_dec, backend, kv, tiers = request.param
    made = Pair(models[kv], tp_pre, tp_dec, backend, tiers)
    pids = made.pre.core.info.tp_worker_pids + made.dec.core.info.tp_worker_pids
    assert len(pids) == 1  # the TP-2 side's worker rank
    yield made
    made.pre.shutdown()
    made.dec.shutdown()
    assert not any(process_alive(p) for p in pids)


def stats(eng: Engine) -> dict:
    return eng.core.view.connector_stats()


def test_pd_with_tp_equals_one_engine(pair):
    """fp32 greedy through PD with these TP sizes equals a plain engine's output token for token,
    over chunked prompts and a second turn whose prefix decode's own cache serves (the transfer then
    starts mid-prompt). The TP side staged whole-head KV on rank 0 and holds none of it after."""
    one = Engine(model=pair.model, page_size=16, **OPTS)
    try:
        sp = {**G, "max_new_tokens": 8}
        want = [o["output_ids"] for o in one.generate(input_ids=PROMPTS, sampling_params=sp)]
        pre, dec = pair.pre, pair.dec
        before = stats(dec)["tokens"]
        got = pair.run(PROMPTS, sp)
        assert [r["output_ids"] for r in got] == want
        assert stats(dec)["tokens"] - before == sum(len(p) for p in PROMPTS)
        # Turn 2: decode's prefix cache holds turn 1, so only the rest moves.
        turn2 = PROMPTS[3] + want[3] + list(range(100, 130))
        sp2 = {**G, "max_new_tokens": 6}
        ref2 = one.generate(input_ids=turn2, sampling_params=sp2)["output_ids"]
        before = stats(dec)["tokens"]
        (r2,) = pair.run([turn2], sp2)
        assert r2["output_ids"] == ref2
        assert 0 < stats(dec)["tokens"] - before < len(turn2) - 40, stats(dec)
        for eng, tp in zip((pre, dec), pair.sizes):
            until_idle(eng)
            st = stats(eng)
            assert st["frames_refused"] == 0 and st["staged_bytes"] == 0, st
            assert st["kv_frames"] > 0, st  # the built-in frames (a TP side never writes by Mooncake)
            assert (st["staged_peak_bytes"] > 0) == (tp > 1), st
            assert_idle_clean(eng)
        assert_idle_clean(one)
    finally:
        one.shutdown()


def _wait(cond, engines=(), timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        for e in engines:
            e.step()
        time.sleep(0.005)


def test_an_abort_on_decode_while_kv_is_in_flight_frees_both_sides(pair):
    """(a) Aborted while waiting for KV: prefill is told and holds nothing. (b) Decode TP 2: aborted
    with the whole KV staged on decode's rank 0, not yet placed on the ranks: the staging is dropped,
    prefill (acknowledged) releases. (c) Aborted when prefill's request has just finished (prefill
    TP 2: its heads about to be collected, or being sent): whatever the timing, both sides end clean,
    and the pair serves on."""
    pre, dec, port = pair.pre, pair.dec, pair.port
    sp = {**G, "max_new_tokens": 4}
    p = list(range(60, 110))
    # (a)
    dec.add_request(p, sp, rid="da", disagg=room(port, 901))
    dec.step()
    assert "req da [waiting for kv]" in owners(dec)
    dec.abort("da")
    assert drive([dec], {id(dec): ["da"]})["da"]["meta_info"]["finish_reason"]["type"] == "abort"
    pre.add_request(p, sp, rid="pa", disagg=room(port, 901))
    _wait(lambda: pre.result("pa", pop=False) is not None and pre.core.scheduler.idle, [pre])
    if pair.sizes[1] == 2:  # (b)
        dec.add_request(p, sp, rid="db", disagg=room(port, 902))
        pre.add_request(p, sp, rid="pb", disagg=room(port, 902))
        dec.step()  # admitted and claimed; from here only prefill steps
        _wait(lambda: bool(dec.core.disagg_connector._to_place), [pre])
        assert stats(dec)["staged_bytes"] == dec.core.disagg_connector.layout.bytes_per_token * len(p)
        assert "req db [waiting for kv]" in owners(dec)
        dec.abort("db")
        assert drive([dec], {id(dec): ["db"]})["db"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert stats(dec)["staged_bytes"] == 0
        until_idle(pre)  # acknowledged when the last frame came: released
    # (c)
    dec.add_request(p, sp, rid="dc", disagg=room(port, 903))
    pre.add_request(p, sp, rid="pc", disagg=room(port, 903))
    dec.step()
    _wait(lambda: pre.result("pc", pop=False) is not None, [pre])
    dec.abort("dc")
    assert drive([dec], {id(dec): ["dc"]})["dc"]["meta_info"]["finish_reason"]["type"] == "abort"
    until_idle(pre)
    until_idle(dec)
    for eng in (pre, dec):
        assert owners(eng) == {} and stats(eng)["staged_bytes"] == 0, stats(eng)
        assert_idle_clean(eng)
    assert len(pair.run([p], sp)[0]["output_ids"]) == 4  # the pair serves on


def test_shared_prefix_families_equal_one_engine(pair):
    """Shared-prefix families over 3x a tiers pair's pools, each asked twice: output equals one
    engine's. With the hierarchical cache on both sides (each rank's tiers move its own heads):
    prefill loads evicted prefixes from its L2 before sending (on a TP prefill every rank loads its
    heads, then they are collected); decode's received KV, placed on every rank, enters its tiers, and
    its L2 serves a later prompt's prefix, so the transfer moves only the rest. Books clean, L2 too."""
    rng = random.Random(0)
    fams = [[rng.randrange(1, 250) for _ in range(96)] for _ in range(8)]
    prompts = [f + [rng.randrange(1, 250) for _ in range(8)] for f in fams for _ in range(2)]
    sp = {**G, "max_new_tokens": 6}
    one = Engine(model=pair.model, page_size=16, **OPTS)
    try:
        want = [o["output_ids"] for o in one.generate(input_ids=prompts, sampling_params=sp)]
        assert_idle_clean(one)
    finally:
        one.shutdown()
    got = [pair.run([p], sp)[0]["output_ids"] for _ in range(2) for p in prompts]
    assert got == want + want
    if pair.tiers:
        hp, hd = (e.memory()["hicache"] for e in (pair.pre, pair.dec))
        assert hp["l2_hit_tokens"] > 0 and hd["backed_up_pages"] > 0 and hd["l2_hit_tokens"] > 0, (hp, hd)
    for eng in (pair.pre, pair.dec):
        until_idle(eng)
        assert stats(eng)["staged_bytes"] == 0
        assert_idle_clean(eng)
