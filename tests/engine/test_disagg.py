"""PD disaggregation through the real transport: a prefill engine and a decode engine (the tiny
Llama, fp32, strict memory) in one process, talking over ZMQ/TCP on 127.0.0.1. Greedy output equals
a single engine's; the ledger names each side's held pages while KV is in flight; every way a
transfer can end (done, prebuilt finish, fake health check, abort on either side, timeouts, refused
frames) leaves both books clean."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import zmq

from kvledger.common.disagg import FAKE_BOOTSTRAP_HOST, DisaggParams
from kvledger.disagg import auth, wire
from kvledger.disagg.mooncake import available as mooncake_missing
from tests.helpers import assert_idle_clean, record_drafts
from tests.server_harness import free_port

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# The built-in transport always; Mooncake's engine where it is installed (.ci/run installs it).
BACKENDS = pytest.mark.parametrize(
    "backend",
    [
        "tcp",
        pytest.param(
            "mooncake", marks=pytest.mark.skipif(bool(mooncake_missing()), reason=str(mooncake_missing()))
        ),
    ],
)


@pytest.fixture
def pd(make_engine):
    """``pd(**kw)`` -> (prefill, decode, port); prefill pages of 16 and decode pages of 4, so the
    transfer is token-granular; connectors closed at teardown."""
    made = []

    def build(prefill_kw=None, decode_kw=None, with_prefill=True, backend="tcp"):
        port = free_port()
        pre = None
        if with_prefill:
            pre = make_engine(
                disaggregation_transfer_backend=backend,
                disaggregation_mode="prefill",
                disaggregation_bootstrap_port=port,
                disaggregation_bind_host="127.0.0.1",
                page_size=16,
                **(prefill_kw or {}),
            )
            made.append(pre)
        dec = make_engine(
            disaggregation_transfer_backend=backend,
            disaggregation_mode="decode",
            disaggregation_bootstrap_port=port,
            page_size=4,
            **(decode_kw or {}),
        )
        made.append(dec)
        return pre, dec, port

    yield build
    for eng in made:
        eng.core.disagg_connector.timeout_s = 0.2  # a failed test must not wait out the default timeouts
        eng.run_until_idle()
        eng.core.disagg_connector.close()


def drive(engines, rids_by_engine, timeout=30.0) -> dict:
    """Step every engine until each of its rids has a result (the transport runs in threads)."""
    results: dict = {}
    deadline = time.monotonic() + timeout
    while any(r not in results for rids in rids_by_engine.values() for r in rids):
        assert time.monotonic() < deadline, f"stuck: have {sorted(results)}"
        for eng in engines:
            eng.step()
            for rid in rids_by_engine.get(id(eng), []):
                if rid not in results and eng.result(rid, pop=False) is not None:
                    results[rid] = eng.result(rid)
        time.sleep(0.001)
    return results


def until_idle(eng, timeout: float = 10.0) -> None:
    """Step ``eng`` until it is idle, giving its transport thread time between steps."""
    deadline = time.monotonic() + timeout
    while not eng.core.scheduler.idle:
        assert time.monotonic() < deadline, owners(eng)
        eng.step()
        time.sleep(0.005)


def room(port: int, n: int, host: str = "127.0.0.1") -> DisaggParams:
    return DisaggParams(host, port, n)


def owners(eng) -> dict[str, int]:
    return {h.owner: len(h.own_pages) for h in eng.core.scheduler.holdings() if h.kind == "request"}


def stats(eng) -> dict:
    return eng.core.view.connector_stats()


PROMPTS = [[5], list(range(3, 8)), list(range(20, 37)), [(7 * i) % 250 + 1 for i in range(41)]]


@BACKENDS
def test_pd_greedy_equals_a_single_engine(pd, make_engine, backend):
    ref_eng = make_engine()
    refs = [
        ref_eng.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 8})["output_ids"]
        for p in PROMPTS
    ]
    pre, dec, port = pd(backend=backend)
    rids = []
    for i, p in enumerate(PROMPTS):
        sp = {**GREEDY, "max_new_tokens": 8}
        pre.add_request(p, sp, rid=f"p{i}", disagg=room(port, 100 + i))
        dec.add_request(p, sp, rid=f"d{i}", disagg=room(port, 100 + i))
        rids.append(i)
    res = drive([pre, dec], {id(pre): [f"p{i}" for i in rids], id(dec): [f"d{i}" for i in rids]})
    for i, ref in enumerate(refs):
        assert res[f"p{i}"]["output_ids"] == ref[:1]  # prefill samples the first token only
        assert res[f"d{i}"]["output_ids"] == ref, i
        assert res[f"d{i}"]["meta_info"]["finish_reason"]["type"] == "length"
    assert stats(dec)["transfers_ok"] == len(PROMPTS) and stats(pre)["transfers_ok"] == len(PROMPTS)
    assert stats(dec)["tokens"] == sum(len(p) for p in PROMPTS)
    assert stats(dec)["frames_refused"] == 0
    # Mooncake wrote the pages itself: no KV went through the control socket.
    assert (stats(dec)["kv_frames"] == 0) == (backend == "mooncake")
    assert (stats(pre)["kv_frames"] == 0) == (backend == "mooncake")
    assert_idle_clean(pre)
    assert_idle_clean(dec)


class RogueDecodeClient:
    """A decode side driven by hand over the wire (claims, and acks only when the test says); with
    ``key`` its messages are sealed under it (a peer that holds the PD nodes' key)."""

    def __init__(self, port: int, layout: wire.Layout, key: bytes | None = None):
        self.layout = layout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sealer = auth.Sealer(key, auth.TO_PREFILL)
        self.opener = auth.Opener(key, auth.TO_DECODE)

    def send(self, msg) -> list[bytes]:
        """Send ``msg`` sealed; returns its frames (for a replay)."""
        frames = wire.pack(msg, self.sealer)
        self.sock.send_multipart(frames)
        return frames

    def recv(self):
        return wire.unpack(self.sock.recv_multipart(), self.opener)[0]

    def claim(self, room_id: int, prompt: list[int], tokens: list[int] | None = None) -> list[bytes]:
        c = wire.Claim(room_id, len(prompt), 0, wire.tokens_crc(prompt), self.layout, tokens=tokens)
        return self.send(c)

    def until_done(self, pre, room_id: int, timeout: float = 10.0) -> None:
        """Step ``pre`` until the room's Done came (its KV frames before it)."""
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, "prefill never sent the room's KV"
            pre.step()
            if self.sock.poll(5):
                msg = self.recv()
                if isinstance(msg, wire.Done) and msg.room == room_id:
                    return

    def ack(self, room_id: int) -> list[bytes]:
        return self.send(wire.Ack(room_id))

    def close(self) -> None:
        self.sock.close()


@BACKENDS
def test_the_ledger_names_each_side_while_kv_is_in_flight(pd, backend):
    pre, dec, port = pd(backend=backend)
    p = list(range(30, 60))
    sp = {**GREEDY, "max_new_tokens": 4}
    pre.add_request(p, sp, rid="p7", disagg=room(port, 7))
    for _ in range(10):
        pre.step()
    # Prefill waits for the decode side to claim the room, holding nothing.
    assert owners(pre) == {} and pre.result("p7", pop=False) is None
    assert not pre.core.scheduler.idle
    # Decode admits a request whose prefill has not even started: its pages wait for the KV.
    dec.add_request(p, sp, rid="d8", disagg=room(port, 8))
    dec.step()
    assert owners(dec) == {"req d8 [waiting for kv]": -(-len(p) // 4)}
    assert dec.memory()["kv_private"] == -(-len(p) // 4) * 4
    # A claimant that has not acknowledged yet: prefill answered (its one token) and keeps the KV.
    rogue = RogueDecodeClient(port, pre.core.connector.layout)
    try:
        rogue.claim(7, p)
        rogue.until_done(pre, 7)
        assert pre.result("p7", pop=False)["output_ids"] and owners(pre) == {"req p7 [kv sending]": 2}
        rogue.ack(7)
        pre.add_request(p, sp, rid="p8", disagg=room(port, 8))
        res = drive([pre, dec], {id(pre): ["p8"], id(dec): ["d8"]})
    finally:
        rogue.close()
    assert res["d8"]["output_ids"][:1] == res["p8"]["output_ids"] and len(res["d8"]["output_ids"]) == 4
    until_idle(pre)
    assert owners(pre) == {} and owners(dec) == {}
    assert_idle_clean(pre)
    assert_idle_clean(dec)


@BACKENDS
def test_decode_prefix_cache_shortens_the_transfer(pd, backend):
    pre, dec, port = pd(backend=backend)
    p = list(range(40, 80))
    sp = {**GREEDY, "max_new_tokens": 3}
    outs = []
    for k in range(2):
        pre.add_request(p, sp, rid=f"p{k}", disagg=room(port, k))
        dec.add_request(p, sp, rid=f"d{k}", disagg=room(port, k))
        outs.append(drive([pre, dec], {id(pre): [f"p{k}"], id(dec): [f"d{k}"]})[f"d{k}"])
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    # Transferred KV is not a cache hit: the first time nothing was cached on either side; the
    # second time decode's own match (36 of 40 on pages of 4: reuse stops short of the last token)
    # reaches further than prefill's (32 on pages of 16), so that is what was served from a cache.
    assert outs[0]["meta_info"]["cached_tokens"] == 0, outs[0]["meta_info"]
    assert outs[1]["meta_info"]["cached_tokens"] == 36, outs[1]["meta_info"]
    # The second transfer sent only what decode's own radix cache did not have (reuse stops short
    # of the last token, and at a page boundary).
    assert stats(dec)["tokens"] < 2 * len(p)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


@BACKENDS
def test_cached_tokens_count_prefills_cache_hit_not_the_transfer(pd, backend):
    """Through PD, ``cached_tokens`` is what a cache served: here prefill's own prefix match (the
    prompt was served there before, whole), while decode had nothing and received it all."""
    pre, dec, port = pd(backend=backend)
    p = list(range(40, 80))
    sp = {**GREEDY, "max_new_tokens": 3}
    pre.add_request(p, sp, rid="warm")  # served by prefill alone: no room, its KV cached there
    assert drive([pre], {id(pre): ["warm"]})["warm"]["meta_info"]["cached_tokens"] == 0
    pre.add_request(p, sp, rid="p0", disagg=room(port, 0))
    dec.add_request(p, sp, rid="d0", disagg=room(port, 0))
    res = drive([pre, dec], {id(pre): ["p0"], id(dec): ["d0"]})
    assert res["p0"]["meta_info"]["cached_tokens"] == 32  # pages of 16, short of the last token
    assert res["d0"]["meta_info"]["cached_tokens"] == 32, res["d0"]["meta_info"]
    assert stats(dec)["tokens"] == len(p)  # decode still received every token by transfer
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_turn_3_aborted_mid_transfer_keeps_the_books_on_both_sides(pd, make_engine):
    """A conversation through PD: turns 1 and 2 complete; turn 3 is aborted on decode while prefill
    is computing its KV (claimed, nothing sent yet). While in flight, decode's books show the prefix
    it matched as the tree's (protected by the turn's lock) and the rest as the turn's pages waiting
    for KV; after the abort both sides are clean, the matched prefix is still cached, and turn 3 sent
    again is served from it with the single-engine output."""
    pre, dec, port = pd(prefill_kw={"chunked_prefill_size": 16})
    sp = {**GREEDY, "max_new_tokens": 6}
    history: list[int] = []
    for turn, new in enumerate([list(range(10, 40)), list(range(50, 70))]):
        prompt = history + new
        pre.add_request(prompt, sp, rid=f"p{turn}", disagg=room(port, turn))
        dec.add_request(prompt, sp, rid=f"d{turn}", disagg=room(port, turn))
        out = drive([pre, dec], {id(pre): [f"p{turn}"], id(dec): [f"d{turn}"]})[f"d{turn}"]
        history = prompt + out["output_ids"]
    prompt = history + list(range(80, 130))
    dec.add_request(prompt, sp, rid="d2", disagg=room(port, 2))
    pre.add_request(prompt, sp, rid="p2", disagg=room(port, 2))
    dec.step()
    mem = dec.memory()
    matched = mem["kv_cached_protected"]  # decode's own prefix: the earlier turns' KV, locked
    assert matched >= 4 * (len(history) // 4) - 4 > 0, mem
    waiting = owners(dec)["req d2 [waiting for kv]"]
    assert waiting * 4 + matched >= len(prompt), (waiting, matched)
    deadline = time.monotonic() + 10
    while owners(pre).get("req p2", 0) == 0:  # claimed: prefill is computing, chunk by chunk
        assert time.monotonic() < deadline, owners(pre)
        pre.step()
        dec.step()
        time.sleep(0.005)
    assert pre.result("p2", pop=False) is None and dec.result("d2", pop=False) is None
    dec.abort("d2")
    res = drive([dec], {id(dec): ["d2"]})
    assert res["d2"]["meta_info"]["finish_reason"]["type"] == "abort"
    drive([pre], {id(pre): ["p2"]})
    until_idle(pre)
    until_idle(dec)
    assert owners(pre) == {} and owners(dec) == {}
    assert dec.memory()["kv_cached_protected"] == 0
    assert dec.memory()["kv_cached_evictable"] >= matched  # the prefix outlived the aborted turn
    assert_idle_clean(pre)
    assert_idle_clean(dec)
    # Turn 3 again: decode's cache serves the prefix, and the output is one engine's.
    pre.add_request(prompt, sp, rid="p3", disagg=room(port, 3))
    dec.add_request(prompt, sp, rid="d3", disagg=room(port, 3))
    again = drive([pre, dec], {id(pre): ["p3"], id(dec): ["d3"]})["d3"]
    one = make_engine()
    want = one.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    assert again["output_ids"] == want
    assert again["meta_info"]["cached_tokens"] >= matched, again["meta_info"]
    until_idle(pre)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


@pytest.mark.parametrize("ending", ["max_new_tokens_1", "stop_token_first"])
@BACKENDS
def test_seed_003_a_request_finished_by_its_first_token_runs_every_release_hook(pd, ending, backend):
    """Seed 003: on the decode side's "prebuilt" path a request can be finished by prefill's first
    token alone, with no forward. It must end through the one release path, every hook called."""
    pre, dec, port = pd(backend=backend)
    p = list(range(9, 30))
    sp = {**GREEDY, "max_new_tokens": 1}
    if ending == "stop_token_first":
        probe = pre.generate(input_ids=p, sampling_params=sp)["output_ids"][0]
        sp = {"temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": [probe]}
    called: list[str] = []
    dec.core.scheduler.release_hooks.append(lambda r: called.append(r.rid))
    pre.add_request(p, sp, rid="p", disagg=room(port, 3))
    dec.add_request(p, sp, rid="d", disagg=room(port, 3))
    forwards = 0
    deadline = time.monotonic() + 30
    while dec.result("d", pop=False) is None:
        assert time.monotonic() < deadline
        pre.step()
        dec.step()
        forwards += dec.core.last_step_ran
        time.sleep(0.001)
    res = dec.result("d")
    assert len(res["output_ids"]) == 1
    want = "length" if ending == "max_new_tokens_1" else "stop"
    assert res["meta_info"]["finish_reason"]["type"] == want
    assert forwards == 0, "the decode side ran a forward for a request its first token finished"
    assert called == ["d"], "a release hook was skipped on the prebuilt path"
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_fake_bootstrap_health_checks_move_nothing_and_cache_nothing(pd):
    pre, dec, _ = pd()
    fake = DisaggParams(FAKE_BOOTSTRAP_HOST, None, 0)
    called: list[str] = []
    dec.core.scheduler.release_hooks.append(lambda r: called.append(r.rid))
    dec.add_request([1, 2, 3], {"max_new_tokens": 1}, rid="hd", disagg=fake)
    pre.add_request([1, 2, 3], {"max_new_tokens": 1}, rid="hp", disagg=fake)
    res = drive([pre, dec], {id(pre): ["hp"], id(dec): ["hd"]})
    assert res["hd"]["meta_info"]["finish_reason"]["type"] == "length" and called == ["hd"]
    assert res["hp"]["meta_info"]["finish_reason"]["type"] == "length"
    # The decode side's pages held no real KV: nothing of them may be cached.
    assert dec.memory()["kv_cached_evictable"] == 0
    assert stats(dec)["transfers_ok"] == 0 and stats(pre)["transfers_ok"] == 0
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_prefill_never_sends_decode_times_out_and_frees(pd):
    _, dec, port = pd(decode_kw={"disaggregation_waiting_timeout_s": 0.5}, with_prefill=False)
    dec.add_request(list(range(5, 25)), {"max_new_tokens": 4}, rid="d", disagg=room(port, 1))
    res = drive([dec], {id(dec): ["d"]})
    fr = res["d"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "timed out" in fr["message"]
    assert stats(dec)["transfers_timed_out"] == 1
    assert_idle_clean(dec)


def test_an_unmatched_claim_outlives_the_decode_sides_own_wait(pd):
    """Equal timeouts: the decode side owns the wait, so its own timeout answers the client, however
    late its I/O thread ticks; prefill's claim backstop must not beat it (it did on CI by ms)."""
    # The claim must reach prefill before decode's own deadline: CI (2 busy cores) once took over
    # 1 s from add_request to the claim, so decode timed out first and the claim never came.
    t = 3.0
    pre, dec, port = pd(
        prefill_kw={"disaggregation_bootstrap_timeout_s": t},
        decode_kw={"disaggregation_waiting_timeout_s": t},
    )
    conn = pre.core.connector
    dec.add_request(list(range(5, 25)), {"max_new_tokens": 4}, rid="d", disagg=room(port, 3))
    deadline = time.monotonic() + 10
    while 3 not in conn._claims:
        timed_out = stats(dec)["transfers_timed_out"]
        assert not timed_out, "decode timed out before its claim reached prefill (machine too slow?)"
        assert time.monotonic() < deadline, "the claim never reached prefill"
        dec.step()
        time.sleep(0.005)
    conn._on_tick(conn._claims[3].at + 1.5 * t)  # decode's deadline has passed; its tick is late
    assert 3 in conn._claims
    res = drive([dec], {id(dec): ["d"]})
    fr = res["d"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "timed out" in fr["message"], fr
    assert stats(dec)["transfers_timed_out"] == 1 and stats(dec)["transfers_failed"] == 0
    while 3 in conn._claims:  # decode's Fail takes the claim away
        assert time.monotonic() < deadline, "prefill kept the claim"
        time.sleep(0.01)
    until_idle(dec)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_decode_never_claims_prefill_times_out_and_frees(pd):
    pre, _, port = pd(prefill_kw={"disaggregation_bootstrap_timeout_s": 0.5})
    pre.add_request(list(range(5, 25)), {"max_new_tokens": 4}, rid="p", disagg=room(port, 1))
    pre.step()
    assert owners(pre) == {}  # waits for the claim, holding nothing
    fr = drive([pre], {id(pre): ["p"]})["p"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "no decode server claimed" in fr["message"], fr
    assert stats(pre)["transfers_timed_out"] == 1
    assert pre.memory()["kv_cached_evictable"] == 0  # nothing was computed
    assert_idle_clean(pre)


@BACKENDS
def test_abort_on_decode_while_waiting_frees_both_sides(pd, backend):
    pre, dec, port = pd(backend=backend)
    p = list(range(60, 90))
    dec.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="d", disagg=room(port, 11))
    dec.step()
    assert "req d [waiting for kv]" in owners(dec)
    dec.abort("d")
    res = drive([dec], {id(dec): ["d"]})
    assert res["d"]["meta_info"]["finish_reason"]["type"] == "abort"
    # Prefill runs the request afterwards: decode told it the room is off, so it does not hold.
    pre.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="p", disagg=room(port, 11))
    deadline = time.monotonic() + 10
    while pre.result("p", pop=False) is None or not pre.core.scheduler.idle:
        assert time.monotonic() < deadline, owners(pre)
        pre.step()
        time.sleep(0.005)
    assert owners(pre) == {}
    assert_idle_clean(pre)
    assert_idle_clean(dec)


@BACKENDS
def test_abort_on_prefill_fails_the_decode_side_at_once(pd, backend):
    pre, dec, port = pd(backend=backend)
    p = list(range(60, 200))
    dec.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="d", disagg=room(port, 12))
    pre.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="p", disagg=room(port, 12))
    dec.step()
    time.sleep(0.2)  # the claim reaches prefill first
    pre.abort("p")
    res = drive([pre, dec], {id(pre): ["p"], id(dec): ["d"]}, timeout=10)
    fr = res["d"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "prefill server failed" in fr["message"]
    assert stats(dec)["transfers_failed"] == 1
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_claim_for_a_different_prompt_is_refused(pd):
    pre, dec, port = pd()
    pre.add_request(list(range(10, 30)), {**GREEDY, "max_new_tokens": 2}, rid="p", disagg=room(port, 5))
    dec.add_request(list(range(11, 31)), {**GREEDY, "max_new_tokens": 2}, rid="d", disagg=room(port, 5))
    res = drive([pre, dec], {id(pre): ["p"], id(dec): ["d"]})
    fr = res["d"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "prompt differs" in fr["message"]
    assert stats(pre)["frames_refused"] == 1
    pre.core.connector.timeout_s = 0.1  # the true claimant never comes: let it time out
    until_idle(pre)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


class RoguePrefillServer:
    """A bootstrap endpoint that answers claims with whatever the test says (a broken or hostile
    prefill server; with ``key``, one that holds the PD nodes' key)."""

    def __init__(self, port: int, key: bytes | None = None):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.sealer = auth.Sealer(key, auth.TO_DECODE)
        self.opener = auth.Opener(key, auth.TO_PREFILL)

    def claim(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "no claim arrived"
        peer, *frames = self.sock.recv_multipart()
        return peer, wire.unpack(frames, self.opener)[0]

    def send(self, peer: bytes, msg, payload=None) -> None:
        self.sock.send_multipart([peer, *wire.pack(msg, self.sealer, payload)])

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("attack", ["wrong_size", "foreign_room", "bad_header", "out_of_order"])
def test_bad_frames_are_refused_counted_and_leave_no_trace(pd, attack):
    _, dec, port = pd(decode_kw={"disaggregation_waiting_timeout_s": 3.0}, with_prefill=False)
    rogue = RoguePrefillServer(port)
    try:
        p = list(range(5, 15))
        dec.add_request(p, {**GREEDY, "max_new_tokens": 2}, rid="d", disagg=room(port, 77))
        dec.step()
        peer, claim = rogue.claim()
        assert isinstance(claim, wire.Claim) and claim.room == 77 and claim.num_tokens == len(p)
        bpt = claim.layout.bytes_per_token
        if attack == "wrong_size":
            rogue.send(peer, wire.KVData(77, 0, len(p)), b"\0" * (bpt * len(p) - 1))
        elif attack == "foreign_room":
            rogue.send(peer, wire.KVData(78, 0, len(p)), b"\0" * (bpt * len(p)))
        elif attack == "bad_header":
            rogue.sock.send_multipart([peer, b"KVL\x09garbage", rogue.sealer.seal([b"KVL\x09garbage"])])
        else:
            rogue.send(peer, wire.KVData(77, 4, 2), b"\0" * (bpt * 2))
        res = drive([dec], {id(dec): ["d"]})
        fr = res["d"]["meta_info"]["finish_reason"]
        assert fr["type"] == "abort"
        if attack in ("wrong_size", "out_of_order"):
            assert "refused" in fr["message"]  # a broken transfer fails the request at once
        else:
            assert "timed out" in fr["message"]  # ignored; the real KV never came
        assert stats(dec)["frames_refused"] >= 1
        assert dec.memory()["kv_cached_evictable"] == 0  # nothing of the room was cached
        assert_idle_clean(dec)
    finally:
        rogue.close()


def test_requests_without_a_room_are_served_whole(pd, make_engine):
    pre, dec, _ = pd()
    ref = make_engine().generate(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 5})
    for eng in (pre, dec):
        out = eng.generate(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 5})
        assert out["output_ids"] == ref["output_ids"]
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_room_in_use_is_refused_before_anything_is_held(pd):
    from kvledger.errors import ConflictError

    pre, dec, port = pd()
    for eng in (pre, dec):
        eng.add_request([1, 2, 3], {"max_new_tokens": 2}, rid="a", disagg=room(port, 9))
        with pytest.raises(ConflictError):
            eng.add_request([1, 2, 3], {"max_new_tokens": 2}, rid="b", disagg=room(port, 9))
    drive([pre, dec], {id(pre): ["a"], id(dec): ["a"]})
    assert_idle_clean(pre)
    assert_idle_clean(dec)


@pytest.mark.skipif(bool(mooncake_missing()), reason=str(mooncake_missing()))
def test_mooncake_decode_keeps_its_pages_until_prefill_stops_writing(pd):
    """With Mooncake, prefill writes into decode's pages directly: a decode request that ends with its
    claim open keeps its pages (kv sending) until prefill answers that no write will come."""
    pre, dec, port = pd(backend="mooncake")
    p = list(range(60, 100))
    dec.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="d", disagg=room(port, 21))
    dec.step()
    time.sleep(0.2)  # the claim reaches prefill (which has no such request yet)
    prefill_io = pre.core.connector.io
    prefill_io.close()  # a prefill side that has gone quiet: it cannot answer
    dec.abort("d")
    dec.step()
    assert owners(dec) == {"req d [kv sending]": -(-len(p) // 4)}  # held: prefill may still write
    assert dec.result("d", pop=False)["meta_info"]["finish_reason"]["type"] == "abort"  # answered
    dec.core.connector.timeout_s = 0.2
    with dec.core.connector._lock:  # the drain's deadline (set from the old timeout) passes now
        dec.core.connector._draining = {r: (rid, 0.0) for r, (rid, _) in dec.core.connector._draining.items()}
    until_idle(dec)
    assert owners(dec) == {}
    assert_idle_clean(dec)


@pytest.mark.skipif(bool(mooncake_missing()), reason=str(mooncake_missing()))
def test_mooncake_drain_ends_when_prefill_confirms(pd):
    pre, dec, port = pd(backend="mooncake")
    p = list(range(60, 100))
    dec.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="d", disagg=room(port, 22))
    dec.step()
    time.sleep(0.2)
    dec.abort("d")
    until_idle(dec)
    assert dec.result("d")["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle_clean(dec)
    assert_idle_clean(pre)


def test_a_request_waits_while_the_pool_is_held_by_kv_being_sent(pd, make_engine):
    """Found by the combination fuzz: on a small prefill pool full of finished requests whose KV waits
    for its decode server's acknowledgement (kv sending), the next request was aborted as "too big
    for the KV cache" -- yet those pages come back on the ack (or at the bootstrap timeout). It
    waits, then runs, and its answer equals a single engine's."""
    p1, p2 = list(range(10, 50)), list(range(60, 100))
    sp = {**GREEDY, "max_new_tokens": 3}
    ref = make_engine().generate(input_ids=[p1, p2], sampling_params=sp)
    pre, dec, port = pd(prefill_kw={"max_total_tokens": 64})  # 4 pages of 16: one 40-token prompt
    rogue = RogueDecodeClient(port, pre.core.connector.layout)  # claims p1, acks when told
    try:
        pre.add_request(p1, sp, rid="p1", disagg=room(port, 31))
        rogue.claim(31, p1)
        rogue.until_done(pre, 31)
        assert owners(pre) == {"req p1 [kv sending]": 3}
        dec.add_request(p2, sp, rid="d2", disagg=room(port, 32))
        pre.add_request(p2, sp, rid="p2", disagg=room(port, 32))
        for _ in range(20):
            pre.step()
            dec.step()
            time.sleep(0.002)
        assert pre.result("p2", pop=False) is None, pre.result("p2", pop=False)  # waits: not aborted
        assert owners(pre) == {"req p1 [kv sending]": 3}
        rogue.ack(31)
        res = drive([pre, dec], {id(pre): ["p1", "p2"], id(dec): ["d2"]})
    finally:
        rogue.close()
    assert res["p1"]["output_ids"] == ref[0]["output_ids"][:1]
    assert res["d2"]["output_ids"] == ref[1]["output_ids"]
    assert res["p2"]["output_ids"] == ref[1]["output_ids"][:1]
    until_idle(pre)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_claim_after_the_prefill_request_ended_without_kv_fails_at_once(pd):
    """Found by the combination fuzz: a prefill request that ended without KV to send (aborted, or
    queued out) before its decode side claimed the room was forgotten, so the late claim got no
    answer and the decode request held its pages for the whole waiting timeout (300 s by default).
    The claim is answered at once."""
    pre, dec, port = pd(decode_kw={"disaggregation_waiting_timeout_s": 60.0})
    p = list(range(30, 70))
    pre.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="p", disagg=room(port, 41))
    pre.abort("p")
    assert drive([pre], {id(pre): ["p"]})["p"]["meta_info"]["finish_reason"]["type"] == "abort"
    dec.add_request(p, {**GREEDY, "max_new_tokens": 4}, rid="d", disagg=room(port, 41))
    fr = drive([dec], {id(dec): ["d"]}, timeout=10)["d"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "prefill request ended" in fr["message"], fr
    assert stats(dec)["transfers_timed_out"] == 0
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_running_request_waits_while_the_pool_is_held_by_kv_on_its_way(pd, make_engine):
    """The same rule for a running request (found by the combination fuzz): a decode whose next page
    could only come from pages held for KV still arriving (waiting for kv) was aborted as too big for
    the KV cache. It waits for that KV; then the newest request is retracted as usual, and both
    answers equal a single engine's."""
    pa, pb = list(range(3, 11)), list(range(40, 76))
    sa, sb = {**GREEDY, "max_new_tokens": 30}, {**GREEDY, "max_new_tokens": 4}
    want = make_engine().generate(input_ids=[pa, pb], sampling_params=[sa, sb])
    pre, dec, port = pd(decode_kw={"max_total_tokens": 48})  # 12 pages of 4
    dec.add_request(pb, sb, rid="db", disagg=room(port, 51))
    for _ in range(3):
        dec.step()
    assert owners(dec) == {"req db [waiting for kv]": 9}  # 9 of 12 pages wait for prefill's KV
    a = dec.add_request(pa, sa)  # no room: served whole by the decode engine, in the other 3 pages
    for _ in range(40):
        dec.step()
    assert dec.result(a, pop=False) is None, dec.result(a, pop=False)  # waits: not aborted
    pre.add_request(pb, sb, rid="pb", disagg=room(port, 51))
    res = drive([pre, dec], {id(pre): ["pb"], id(dec): [a, "db"]})
    assert [res[a]["output_ids"], res["db"]["output_ids"]] == [o["output_ids"] for o in want]
    assert dec.core.scheduler.total_retractions > 0
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_prefill_waits_for_the_claim_so_small_pools_cannot_deadlock(pd, make_engine):
    """Found by the combination fuzz (ngram+pd+int8_batch+quantized): decode admitted a short request
    A and held its pages waiting for KV, while a long request B waited for room behind it; prefill
    had computed B, unclaimed, and its KV filled prefill's pool, so A's prefill waited for pages
    that only B's claim would free. Nobody moved until the 60 s timeouts aborted A. Prefill now runs
    a request only once decode has claimed its room (B waits holding nothing), so A goes first."""
    pa, pb = list(range(3, 11)), [(5 * i) % 250 + 1 for i in range(60)]
    sa, sb = {**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 3}
    want = make_engine().generate(input_ids=[pa, pb], sampling_params=[sa, sb])
    long_wait = {"disaggregation_bootstrap_timeout_s": 60.0, "disaggregation_waiting_timeout_s": 60.0}
    pre, dec, port = pd(
        prefill_kw={"max_total_tokens": 64, **long_wait},  # 4 pages of 16: B's prompt fills them
        decode_kw={"max_total_tokens": 64, **long_wait},  # 16 pages of 4: B fits only without A
    )
    dec.add_request(pa, sa, rid="da", disagg=room(port, 61))
    dec.add_request(pb, sb, rid="db", disagg=room(port, 62))
    for _ in range(3):
        dec.step()
    assert owners(dec) == {"req da [waiting for kv]": 2}  # db waits in the queue for room
    pre.add_request(pb, sb, rid="pb", disagg=room(port, 62))
    admits = []
    real_admit = pre.core.kv_manager.admit
    pre.core.kv_manager.admit = lambda r: admits.append(r.rid) or real_admit(r)
    for _ in range(20):
        pre.step()
        time.sleep(0.001)
    pre.core.kv_manager.admit = real_admit
    assert owners(pre) == {}, "prefill computed KV no decode server has claimed"
    assert admits == [], "an unclaimed request took a slot and its prefix each pass, to give them back"
    pre.add_request(pa, sa, rid="pa", disagg=room(port, 61))
    res = drive([pre, dec], {id(pre): ["pa", "pb"], id(dec): ["da", "db"]}, timeout=20)
    assert [res["da"]["output_ids"], res["db"]["output_ids"]] == [o["output_ids"] for o in want]
    assert [res["pa"]["output_ids"], res["pb"]["output_ids"]] == [o["output_ids"][:1] for o in want]
    assert stats(dec)["transfers_timed_out"] == 0 and stats(pre)["transfers_timed_out"] == 0
    until_idle(pre)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


# -- session turns through PD -------------------------------------------------------------------------
# The session lives on decode; the router sends prefill the same body (the turn's input and its
# session_params), and decode's claim carries the turn's whole prompt (history + input).
TURNS = [list(range(10, 40)), list(range(50, 61)), list(range(70, 79)), list(range(90, 97))]
SESSION_SP = {**GREEDY, "max_new_tokens": 6}
_ROOMS = itertools.count(500)


def one_engine_session(make_engine, turns, sp=SESSION_SP) -> list[dict]:
    """The same turns as a session on one engine (decode's pages of 4): the reference."""
    one = make_engine(page_size=4)
    sid = one.open_session()
    outs = [one.generate(input_ids=t, sampling_params=sp, session_params={"id": sid}) for t in turns]
    one.close_session(sid)
    return outs


def send_turn(pre, dec, port: int, sid: str, new: list[int], k, sp=SESSION_SP) -> None:
    """Queue turn ``k`` of session ``sid`` on both sides, as the router does (the same body, the
    same room)."""
    n = next(_ROOMS)
    dec.add_request(new, sp, rid=f"d{k}", session_params={"id": sid}, disagg=room(port, n))
    pre.add_request(new, sp, rid=f"p{k}", session_params={"id": sid}, disagg=room(port, n))


def session_turn(pre, dec, port: int, sid: str, new: list[int], k, sp=SESSION_SP) -> dict:
    send_turn(pre, dec, port, sid, new, k, sp)
    return drive([pre, dec], {id(pre): [f"p{k}"], id(dec): [f"d{k}"]})[f"d{k}"]


def session_of(eng, sid: str) -> dict:
    return next(s for s in eng.sessions() if s["id"] == sid)


@BACKENDS
def test_session_turns_through_pd_equal_one_engine_and_move_only_their_suffix(pd, make_engine, backend):
    """fp32 greedy: four turns of a session opened on decode equal the same session on one engine,
    token for token. Every later turn borrows the session's KV on decode and moves only what lies
    beyond it (its input, plus the previous turn's last token and the partial page); its
    ``cached_tokens`` is what the session served, as on one engine (transferred KV is not a hit)."""
    refs = one_engine_session(make_engine, TURNS)
    pre, dec, port = pd(backend=backend)
    sid = dec.open_session()
    moved_before = 0
    for k, new in enumerate(TURNS):
        kv_before = session_of(dec, sid)["kv_tokens"]
        prompt_len = session_of(dec, sid)["tokens"] + len(new)
        out = session_turn(pre, dec, port, sid, new, k)
        assert out["output_ids"] == refs[k]["output_ids"], k
        assert out["meta_info"]["prompt_tokens"] == refs[k]["meta_info"]["prompt_tokens"] == prompt_len
        borrowed = kv_before // 4 * 4  # the session's full pages
        assert out["meta_info"]["cached_tokens"] == refs[k]["meta_info"]["cached_tokens"] == borrowed, k
        moved = stats(dec)["tokens"] - moved_before
        moved_before = stats(dec)["tokens"]
        assert moved == prompt_len - borrowed, (k, moved)
        if k:
            assert 0 < moved <= len(new) + 4, (k, moved)  # the suffix only, never the history
        s = session_of(dec, sid)
        assert s["tokens"] == prompt_len + len(out["output_ids"]) and s["busy_rid"] is None
    assert stats(pre)["tokens"] == stats(dec)["tokens"] and stats(dec)["frames_refused"] == 0
    assert stats(dec)["transfers_ok"] == len(TURNS)
    assert pre.sessions() == []  # prefill never holds the session
    dec.close_session(sid)
    until_idle(pre)


# -- PD with a draft model: decode recomputes the draft's prompt K/V -----------------------------------

@pytest.mark.parametrize("prefill_has_it", [True, False])
def test_pd_with_a_draft_model_equals_one_engine_without(pd, make_engine, tiny_llama, prefill_has_it):
    """Only the target's KV moves; the draft's prompt K/V is recomputed on decode (its first
    proposal after the admission runs the draft from position 0, over pages the transfer filled or
    decode's prefix cache lent). Greedy output equals one engine without a draft, token for token;
    decode's drafts equal, draft for draft, those of a draft engine that caches nothing, so no draft
    read stale K/V (the target is its own draft here: right K/V means nearly every draft accepted);
    prefill never drafts (it needs no draft model). The second round hits decode's prefix cache:
    recomputed there too."""
    draft = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_llama,
                 speculative_num_draft_tokens=3)  # fmt: skip
    prompts = [*PROMPTS, list(range(60, 130))]
    sp = {**GREEDY, "max_new_tokens": 12}
    plain = make_engine()
    refs = [plain.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    cold = make_engine(page_size=4, enable_prefix_cache=False, **draft)
    cold_drafts = record_drafts(cold)
    assert [cold.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts] == refs
    pre, dec, port = pd(prefill_kw=draft if prefill_has_it else None, decode_kw=draft)
    drafts = record_drafts(dec)
    for rnd in range(2):
        for i, p in enumerate(prompts):  # one at a time: each request's drafts in order
            n = 10 * rnd + i
            pre.add_request(p, sp, rid=f"p{n}", disagg=room(port, 500 + n))
            dec.add_request(p, sp, rid=f"d{n}", disagg=room(port, 500 + n))
            res = drive([pre, dec], {id(pre): [f"p{n}"], id(dec): [f"d{n}"]})
            assert res[f"d{n}"]["output_ids"] == refs[i], (rnd, i)
        assert drafts == cold_drafts, rnd
        drafts.clear()
    assert stats(dec)["tokens"] < 2 * sum(len(p) for p in prompts)  # round 2: decode's cache served
    t = dec.core.scheduler.spec_totals
    assert t.drafted > 0 and t.accepted > 0.9 * t.drafted, t
    assert pre.core.scheduler.spec_totals.drafted == 0
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_session_turn_aborted_while_its_kv_is_in_flight_leaves_the_session(pd, make_engine):
    """Turn 3 is aborted on decode while prefill computes it (claimed, nothing sent): the session on
    decode is exactly as turn 2 left it (tokens, KV, pages), prefill frees everything, and the turn
    sent again is one engine's (the session's KV was not overwritten)."""
    turns = [*TURNS[:2], list(range(70, 150))]  # a long turn 3: prefill computes it in 10 chunks
    refs = one_engine_session(make_engine, turns)
    pre, dec, port = pd(prefill_kw={"chunked_prefill_size": 8})
    sid = dec.open_session()
    for k in range(2):
        session_turn(pre, dec, port, sid, turns[k], k)
    before = session_of(dec, sid)
    held = dec.memory()["kv_session"]
    send_turn(pre, dec, port, sid, turns[2], "x")
    deadline = time.monotonic() + 10
    while owners(pre).get("req px", 0) == 0:  # claimed: prefill is computing, chunk by chunk
        assert time.monotonic() < deadline, owners(pre)
        pre.step()
        dec.step()
        time.sleep(0.005)
    assert "req dx [waiting for kv]" in owners(dec) and session_of(dec, sid)["busy_rid"] == "dx"
    dec.abort("dx")
    res = drive([dec, pre], {id(dec): ["dx"], id(pre): ["px"]})
    assert res["dx"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert stats(dec)["transfers_ok"] == 2  # turn 3's KV never arrived
    until_idle(pre)
    until_idle(dec)
    assert owners(pre) == {} and owners(dec) == {}
    assert session_of(dec, sid) == before and dec.memory()["kv_session"] == held
    assert_idle_clean(pre)
    assert_idle_clean(dec)
    out = session_turn(pre, dec, port, sid, turns[2], 2)
    assert out["output_ids"] == refs[2]["output_ids"]
    assert out["meta_info"]["cached_tokens"] == refs[2]["meta_info"]["cached_tokens"]
    dec.close_session(sid)
    until_idle(pre)


# -- PD with the hierarchical cache on both sides ------------------------------------------------------
def _families(seed: int = 0, families: int = 8, prefix: int = 96) -> list[list[int]]:
    """Shared-prefix families, each asked twice: 8 x 104 tokens, over 3x an L1 of 256 tokens."""
    rng = random.Random(seed)
    fams = [[rng.randrange(1, 250) for _ in range(prefix)] for _ in range(families)]
    return [f + [rng.randrange(1, 250) for _ in range(8)] for f in fams for _ in range(2)]


def _hc(eng) -> dict:
    return eng.memory()["hicache"]


@pytest.mark.parametrize("tier", ["l2", "l3"])
def test_pd_with_the_hierarchy_on_both_sides_equals_one_engine(pd, make_engine, tmp_path, tier):
    """Both sides' pools hold a quarter of the workload. Prefill's prefix match goes through its
    tiers: a prompt evicted from its pool but kept in L2 (or read back from L3 files) is loaded, not
    recomputed, before its KV is sent, and counts as cached. Decode's received KV enters its radix
    tree at the end, so its tiers, like computed KV; decode then loads from its L2 what it holds
    past its L1 prefix (in the admission step, which runs no forward) and the transfer brings only
    the rest; a request without a room loads it back from there too. Output equals one engine's;
    both sides' books (L2 pages too) are clean."""
    sp = {**GREEDY, "max_new_tokens": 6}
    prompts = _families()
    plain = make_engine()
    refs = [plain.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    hier = dict(max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=8)
    pre_kw = dict(hier)
    if tier == "l3":
        pre_kw.update(hicache_ratio=2, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"),
                      hicache_prefetch_threshold=16)  # fmt: skip
    pre, dec, port = pd(prefill_kw=pre_kw, decode_kw=hier)
    metas = []
    for rnd in range(2):
        for i, p in enumerate(prompts):
            n = 100 * rnd + i
            pre.add_request(p, sp, rid=f"p{n}", disagg=room(port, 900 + n))
            dec.add_request(p, sp, rid=f"d{n}", disagg=room(port, 900 + n))
            res = drive([pre, dec], {id(pre): [f"p{n}"], id(dec): [f"d{n}"]})
            assert res[f"d{n}"]["output_ids"] == refs[i], (rnd, i)
            metas.append((res[f"p{n}"]["meta_info"], res[f"d{n}"]["meta_info"]))
    hp, hd = _hc(pre), _hc(dec)
    assert hp["l2_hit_tokens"] > 0 and hp["l1_demoted_pages"] > 0, hp
    if tier == "l3":
        assert hp["l3_hit_tokens"] > 0, hp
    # A tier hit on prefill is a cache hit through PD (decode reports prefill's match where it
    # reaches further than its own); the round-2 prompts were all served from some cache.
    assert all(d["cached_tokens"] == max(p["cached_tokens"], d["cached_tokens"]) for p, d in metas)
    assert all(d["cached_tokens"] >= 96 for _, d in metas[len(prompts):]), metas[len(prompts):]
    assert hd["backed_up_pages"] > 0 and hd["l1_demoted_pages"] > 0, hd  # received KV entered the tiers
    assert hd["l2_hit_tokens"] > 0, hd
    # An old prompt again through PD: both pools have long dropped it. Prefill loads it from its
    # tiers instead of recomputing it; decode's L2 has it too, so the transfer carries only what is
    # past that match, and decode reports it cached.
    p, before, moved, pre_before = prompts[2], hd["l2_hit_tokens"], stats(dec)["tokens"], _hc(pre)["l2_hit_tokens"]
    pre.add_request(p, sp, rid="p-again", disagg=room(port, 999))
    dec.add_request(p, sp, rid="d-again", disagg=room(port, 999))
    again = drive([pre, dec], {id(pre): ["p-again"], id(dec): ["d-again"]})["d-again"]
    assert again["output_ids"] == refs[2]
    assert _hc(pre)["l2_hit_tokens"] - pre_before >= 96, _hc(pre)
    loaded, sent = _hc(dec)["l2_hit_tokens"] - before, stats(dec)["tokens"] - moved
    assert loaded >= 96 and 1 <= sent <= len(p) - loaded, (loaded, sent)
    assert again["meta_info"]["cached_tokens"] >= loaded
    hd = _hc(dec)
    # Served whole on decode (no room): the prefix decode received by transfer comes back from its L2.
    before = hd["l2_hit_tokens"]
    got = dec.generate(input_ids=prompts[0], sampling_params=sp)
    assert got["output_ids"] == refs[0]
    assert _hc(dec)["l2_hit_tokens"] > before and got["meta_info"]["cached_tokens"] >= 96, _hc(dec)
    assert stats(dec)["transfers_ok"] == stats(pre)["transfers_ok"] == 2 * len(prompts) + 1
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_session_turn_aborted_on_prefill_leaves_the_session(pd, make_engine):
    """The other side of the same: prefill's half is aborted (its client went away) while computing;
    decode's turn fails with a 502 at once, its session as it was, and the next turn is exact."""
    refs = one_engine_session(make_engine, TURNS[:2])
    pre, dec, port = pd(prefill_kw={"chunked_prefill_size": 16})
    sid = dec.open_session()
    session_turn(pre, dec, port, sid, TURNS[0], 0)
    before = session_of(dec, sid)
    send_turn(pre, dec, port, sid, TURNS[1], "x")
    deadline = time.monotonic() + 10
    while owners(pre).get("req px", 0) == 0:
        assert time.monotonic() < deadline, owners(pre)
        pre.step()
        dec.step()
        time.sleep(0.005)
    pre.abort("px")
    res = drive([dec, pre], {id(dec): ["dx"], id(pre): ["px"]})
    fin = res["dx"]["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and "the prefill server failed this request" in fin["message"], fin
    until_idle(pre)
    until_idle(dec)
    assert session_of(dec, sid) == before
    assert_idle_clean(pre)
    assert_idle_clean(dec)
    assert session_turn(pre, dec, port, sid, TURNS[1], 1)["output_ids"] == refs[1]["output_ids"]
    dec.close_session(sid)
    until_idle(pre)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_session_turn_too_long_is_refused_on_decode_and_prefill_lets_go_at_once(pd):
    """A turn that would pass the context is a 400 on decode before anything is held; decode tells
    prefill, whose request ends at once (not after its bootstrap timeout) holding nothing."""
    pre, dec, port = pd(decode_kw={"context_length": 64}, prefill_kw={"context_length": 64})
    pre.core.connector.timeout_s = 60.0  # a prefill that waited for the claim would hang the test
    sid = dec.open_session()
    session_turn(pre, dec, port, sid, TURNS[0], 0)
    before = session_of(dec, sid)
    with pytest.raises(Exception) as e:  # the engine API raises the 400 the server answers
        dec.add_request(list(range(1, 40)), SESSION_SP, rid="dx", session_params={"id": sid},
                        disagg=room(port, 600))  # fmt: skip
    assert getattr(e.value, "status", None) == 400 and "context" in str(e.value)
    pre.add_request(list(range(1, 40)), SESSION_SP, rid="px", session_params={"id": sid}, disagg=room(port, 600))
    t0 = time.monotonic()
    res = drive([pre], {id(pre): ["px"]}, timeout=10)
    assert time.monotonic() - t0 < 5
    fin = res["px"]["meta_info"]["finish_reason"]
    # Whether decode's Fail came before prefill's request or after, its reason is what prefill says.
    assert fin["type"] == "abort" and "the decode server refused the request" in fin["message"], fin
    assert "context" in fin["message"], fin
    assert session_of(dec, sid) == before
    dec.close_session(sid)
    until_idle(pre)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_closing_a_session_while_its_turn_is_in_flight_is_deferred(pd, make_engine):
    """Seed 004's rule across two servers: a close while the turn waits for its KV from prefill only
    marks the session; the turn completes with one engine's output, a new turn to the closing
    session is a 404 (and prefill's half of it ends too), and the session's pages go at the turn's
    end. Both sides clean."""
    refs = one_engine_session(make_engine, TURNS[:2])
    pre, dec, port = pd(prefill_kw={"chunked_prefill_size": 16})
    sid = dec.open_session()
    session_turn(pre, dec, port, sid, TURNS[0], 0)
    send_turn(pre, dec, port, sid, TURNS[1], 1)
    dec.step()
    assert "req d1 [waiting for kv]" in owners(dec)
    dec.close_session(sid)
    s = session_of(dec, sid)
    assert s["closing"] and s["busy_rid"] == "d1" and dec.memory()["kv_session"] > 0
    with pytest.raises(Exception) as e:
        dec.add_request(TURNS[2], SESSION_SP, rid="d9", session_params={"id": sid}, disagg=room(port, 509))
    assert getattr(e.value, "status", None) == 404
    pre.add_request(TURNS[2], SESSION_SP, rid="p9", session_params={"id": sid}, disagg=room(port, 509))
    res = drive([pre, dec], {id(pre): ["p1", "p9"], id(dec): ["d1"]})
    assert res["d1"]["output_ids"] == refs[1]["output_ids"]
    assert res["p9"]["meta_info"]["finish_reason"]["type"] == "abort"
    until_idle(pre)
    until_idle(dec)
    assert dec.sessions() == [] and dec.memory()["kv_session"] == 0
    assert_idle_clean(pre)
    assert_idle_clean(dec)


@pytest.mark.parametrize("bad", ["no_tokens", "other_input"])
def test_a_session_turns_claim_without_its_prompt_is_refused(pd, bad):
    """Prefill takes a session turn's prompt from the claim only when it is there and ends with the
    input prefill was sent (length and checksum agreeing): otherwise the request ends (a 502),
    the claimant is told, and nothing is held."""
    pre, _, port = pd()
    new = list(range(5, 15))
    full = list(range(100, 120)) + (new if bad == "no_tokens" else list(range(6, 16)))
    pre.add_request(new, SESSION_SP, rid="p0", session_params={"id": "s"}, disagg=room(port, 700))
    rogue = RogueDecodeClient(port, pre.core.connector.layout)
    try:
        rogue.claim(700, full, tokens=None if bad == "no_tokens" else full)
        res = drive([pre], {id(pre): ["p0"]})
        fin = res["p0"]["meta_info"]["finish_reason"]
        assert fin["type"] == "abort" and "refused the decode server's claim" in fin["message"], fin
        deadline = time.monotonic() + 5
        while not rogue.sock.poll(10):
            assert time.monotonic() < deadline, "the claimant was never told"
            pre.step()
        msg = rogue.recv()
        assert isinstance(msg, wire.Fail) and msg.room == 700
    finally:
        rogue.close()
    assert stats(pre)["frames_refused"] == 1 and stats(pre)["tokens"] == 0
    until_idle(pre)
    assert_idle_clean(pre)


def test_a_request_prefill_refuses_fails_its_decode_half_at_once(pd):
    """The other direction of a refusal before queueing: prefill refuses its half (here a duplicate
    rid, 409); the decode half's claim is answered with a Fail at once (502), not after decode's
    waiting timeout, and nothing is held on either side."""
    pre, dec, port = pd()
    dec.core.connector.timeout_s = 60.0
    p = list(range(5, 25))
    pre.add_request(p, SESSION_SP, rid="busy")  # no room: a plain request holding the rid
    with pytest.raises(Exception) as e:
        pre.add_request(p, SESSION_SP, rid="busy", disagg=room(port, 800))
    assert getattr(e.value, "status", None) == 409
    dec.add_request(p, SESSION_SP, rid="d0", disagg=room(port, 800))
    t0 = time.monotonic()
    res = drive([pre, dec], {id(dec): ["d0"], id(pre): ["busy"]}, timeout=10)
    assert time.monotonic() - t0 < 5
    fin = res["d0"]["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and "the prefill server refused the request" in fin["message"], fin
    until_idle(pre)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_abort_on_decode_after_its_tier_load_while_the_rest_is_awaited(pd, make_engine):
    """Decode loads a prompt's prefix from its L2 in the admission step (no forward runs) and waits
    for the rest by transfer; aborted then, its pages (the loaded ones too) are freed, the L2 copy
    is unpinned and stays cached, and prefill (told the room is off) holds nothing: both books clean."""
    hier = dict(max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=8)
    pre, dec, port = pd(prefill_kw=hier, decode_kw=hier)
    prompts = _families()
    sp = {**GREEDY, "max_new_tokens": 4}
    for p in prompts:  # served whole on decode: the first family ends up in its L2 only
        dec.generate(input_ids=p, sampling_params=sp)
    before = _hc(dec)["l2_hit_tokens"]
    dec.add_request(prompts[0], sp, rid="d", disagg=room(port, 21))
    dec.step()
    assert "req d [waiting for kv]" in owners(dec)
    assert _hc(dec)["l2_hit_tokens"] - before >= 96
    dec.abort("d")
    res = drive([dec], {id(dec): ["d"]})
    assert res["d"]["meta_info"]["finish_reason"]["type"] == "abort"
    pre.add_request(prompts[0], sp, rid="p", disagg=room(port, 21))
    deadline = time.monotonic() + 10
    while pre.result("p", pop=False) is None or not pre.core.scheduler.idle:
        assert time.monotonic() < deadline, owners(pre)
        pre.step()
        time.sleep(0.005)
    assert owners(pre) == {} and _hc(dec)["l2_loading"] == 0
    assert_idle_clean(pre)
    assert_idle_clean(dec)
    # The L2 copy is still there: served again from it, exactly.
    again = dec.generate(input_ids=prompts[0], sampling_params=sp)
    assert again["meta_info"]["cached_tokens"] >= 96
    assert again["output_ids"] == make_engine().generate(input_ids=prompts[0], sampling_params=sp)["output_ids"]
