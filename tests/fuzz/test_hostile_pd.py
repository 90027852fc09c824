"""The PD bootstrap port and the decode side's KV stream against hostile peers (issue 50, items 2 and 9).

A prefill and a decode engine (the tiny Llama, fp32, strict memory) share a key; a peer without it
sends claims, failures, acknowledgements and KV that would take a room, end it or write into it, and
garbage of every shape; a peer with it replays what it sent. Each is refused and counted, never
answered and never applied; a bystander request beside it completes with one engine's greedy output,
and both books are clean. The helpers (``hostile_messages``, ``send_hostile``, ``replay``) are what a
longer hostile-client fuzz drives at a live bootstrap port.

The seal is built here from its description (``disagg/auth.py``), not with the product's code, so a
forged seal is refused for its key, not for its shape (``test_the_helpers_seal_is_the_wires``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvledger.common.disagg import DisaggParams
from kvledger.disagg import auth, wire
from kvledger.errors import ValidationError
from tests.helpers import assert_idle_clean
from tests.server_harness import free_port

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}
KEY = b"0123456789abcdef0123456789abcdef-pd-test-key"
WRONG_KEY = b"fedcba9876543210fedcba9876543210-not-the-key"
TO_PREFILL = b"kvledger-pd-v3 decode->prefill"  # the labels disagg/auth.py documents
TO_DECODE = b"kvledger-pd-v3 prefill->decode"
PROMPT = [(7 * i) % 250 + 1 for i in range(37)]


# -- helpers a hostile-client fuzz drives -------------------------------------------------------------
def seal(parts: list[bytes], key: bytes | None, label: bytes = TO_PREFILL, *, session: bytes | None = None,
         seq: int = 1, ts: float | None = None) -> bytes:  # fmt: skip
    """A seal frame as the wire describes it: session (16) | seq (8) | ms timestamp (8) | HMAC-SHA256
    of label | the 32 bytes before it | each frame's length (8) and bytes. ``key`` None: a zero MAC."""
    head = (session or os.urandom(16)) + struct.pack(">QQ", seq, int((time.time() if ts is None else ts) * 1000))
    if key is None:
        return head + bytes(32)
    h = hmac.new(key, label, hashlib.sha256)
    h.update(head)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return head + h.digest()


def layout_of(eng) -> wire.Layout:
    return eng.core.disagg_connector.layout


def hostile_messages(rng: random.Random, layout: wire.Layout, rooms: list[int], *,
                     well_formed: bool = True) -> Iterator[tuple[str, list[bytes]]]:  # fmt: skip
    """Endless (kind, frames) from a peer without the key: random bytes, wrong frame counts, truncated
    and oversized headers, wrong versions and types, seals of the wrong size; with ``well_formed``
    also valid claims, failures and acks for ``rooms`` unsealed, with a zero MAC or under another key
    (those a server with no key accepts by design: leave them out against one)."""
    claim = wire.encode(wire.Claim(rooms[0], len(PROMPT), 0, wire.tokens_crc(PROMPT), layout))
    while True:
        room = rng.choice(rooms)
        good = [
            wire.encode(wire.Claim(room, len(PROMPT), 0, wire.tokens_crc(PROMPT), layout)),
            wire.encode(wire.Claim(room, 10**6, 0, 0, layout, tokens=list(range(1000)))),
            wire.encode(wire.Fail(room, "x" * rng.randrange(1, 5000))),
            wire.encode(wire.Ack(room)),
        ]
        kind = rng.choice(["random", "multi", "truncated", "version", "wrong_type", "seal_size", "empty",
                           "oversized" if rng.random() < 0.03 else "random"]
                          + (["unsealed", "zero_mac", "wrong_key"] * 2 if well_formed else []))  # fmt: skip
        if kind == "random":
            frames = [rng.randbytes(rng.randrange(0, 300))]
        elif kind == "multi":
            frames = [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.choice([2, 3, 4, 7]))]
        elif kind == "truncated":
            cut = claim[: rng.randrange(0, len(claim))]
            frames = [cut, seal([cut], WRONG_KEY)]
        elif kind == "version":
            hdr = b"KVL" + bytes([rng.choice([0, 1, 2, 4, 255])]) + claim[4:]
            frames = [hdr, seal([hdr], WRONG_KEY)]
        elif kind == "wrong_type":
            body = rng.choice([
                msgspec.msgpack.encode({"type": "claim", "room": "x"}),
                msgspec.msgpack.encode([1, 2, 3]),
                msgspec.msgpack.encode({"type": "nope"}),
                msgspec.msgpack.encode(wire.Done(room, 3, 1)),  # untagged: a Struct without its tag
                wire.encode(wire.KVData(room, 0, 1))[4:],
            ])  # fmt: skip
            hdr = b"KVL\x03" + body
            frames = [hdr, rng.randbytes(16), seal([hdr], WRONG_KEY)]
        elif kind == "seal_size":
            frames = [claim, rng.randbytes(rng.choice([0, 1, 63, 65, 200]))]
        elif kind == "empty":
            frames = [b""]
        elif kind == "oversized":  # over the header limit, under the socket's: counted here
            hdr = b"KVL\x03" + bytes(wire.MAX_HEADER_BYTES + 1)
            frames = [hdr, seal([hdr], WRONG_KEY)]
        elif kind == "unsealed":
            frames = [rng.choice(good)]
        elif kind == "zero_mac":
            hdr = rng.choice(good)
            frames = [hdr, seal([hdr], None)]
        else:
            hdr = rng.choice(good)
            frames = [hdr, seal([hdr], WRONG_KEY)]
        yield kind, frames


class Dealers:
    """A few connections to a bootstrap port, as many peers."""

    def __init__(self, port: int, n: int = 4):
        self.port = port
        self.socks = [self._new() for _ in range(n)]

    def _new(self) -> zmq.Socket:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.port}")
        return s

    def send(self, frames: list[bytes], i: int | None = None) -> None:
        s = self.socks[i if i is not None else random.randrange(len(self.socks))]
        s.send_multipart(frames, copy=False)

    def answers(self) -> int:
        """Messages any of them received (a refused message is never answered)."""
        n = 0
        for s in self.socks:
            while s.poll(0):
                s.recv_multipart()
                n += 1
        return n

    def close(self) -> None:
        for s in self.socks:
            s.close()


def send_hostile(port: int, n: int, layout: wire.Layout, rooms: list[int], *, seed: int = 0,
                 well_formed: bool = True, dealers: Dealers | None = None) -> Counter:  # fmt: skip
    """Send ``n`` hostile messages (``hostile_messages``) to the bootstrap port at ``port``; returns
    how many of each kind were sent (each one the server must refuse and count)."""
    rng = random.Random(seed)
    own = dealers is None
    dealers = dealers or Dealers(port)
    sent: Counter = Counter()
    try:
        for (kind, frames), _ in zip(hostile_messages(rng, layout, rooms, well_formed=well_formed), range(n)):
            dealers.send(frames)
            sent[kind] += 1
    finally:
        if own:
            time.sleep(0.2)  # let ZMQ flush before the sockets close
            dealers.close()
    return sent


def replay(port: int, recorded: list[list[bytes]], n: int) -> None:
    """Send each recorded message ``n`` times again, over new connections and an old one alike."""
    dealers = Dealers(port, 3)
    try:
        for k in range(n):
            for frames in recorded:
                dealers.send(frames, k % 3)
        time.sleep(0.2)
    finally:
        dealers.close()


# -- the pair under attack ----------------------------------------------------------------------------
@pytest.fixture
def key_file(tmp_path) -> str:
    path = tmp_path / "pd.key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def pair(make_engine, key_file):
    """``pair(keyed=True, **prefill_kw)`` -> (prefill, decode, port): both with the shared key (or
    neither), decode allowed to reach the prefill's port only."""
    made = []

    def build(keyed: bool = True, prefill_kw=None, decode_kw=None):
        port = free_port()
        key = {"disaggregation_auth_key_file": key_file} if keyed else {}
        pre = make_engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                          disaggregation_bind_host="127.0.0.1", **key, **(prefill_kw or {}))  # fmt: skip
        dec = make_engine(disaggregation_mode="decode", disaggregation_prefill_peers=[f"127.0.0.1:{port}"],
                          page_size=4, **key, **(decode_kw or {}))  # fmt: skip
        made.extend([pre, dec])
        return pre, dec, port

    yield build
    for eng in made:
        eng.core.disagg_connector.timeout_s = 0.2  # a failed test must not wait out the default timeouts
        eng.run_until_idle()
        eng.core.disagg_connector.close()


def room(port: int, n: int) -> DisaggParams:
    return DisaggParams("127.0.0.1", port, n)


def stats(eng) -> dict:
    return eng.core.view.connector_stats()


def owners(eng) -> dict[str, int]:
    return {h.owner: len(h.own_pages) for h in eng.core.scheduler.holdings() if h.kind == "request"}


def step_until(engines, cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for eng in engines:
            eng.step()
        time.sleep(0.002)


def drive(engines, rids_by_engine, timeout=30.0) -> dict:
    results: dict = {}
    step_until(
        engines,
        lambda: all(r in results or _take(e, r, results) for e in engines for r in rids_by_engine.get(id(e), [])),
        timeout,
        "results",
    )
    return results


def _take(eng, rid, results) -> bool:
    out = eng.result(rid, pop=False)
    if out is not None:
        results[rid] = eng.result(rid)
    return out is not None


def reference(make_engine, prompt=PROMPT) -> list[int]:
    return make_engine().generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]


def real_request(pre, dec, port: int, n: int, prompt=PROMPT) -> dict:
    """The router's two halves of one request, run to the end; decode's result."""
    pre.add_request(prompt, GREEDY, rid=f"p{n}", disagg=room(port, n))
    dec.add_request(prompt, GREEDY, rid=f"d{n}", disagg=room(port, n))
    return drive([pre, dec], {id(pre): [f"p{n}"], id(dec): [f"d{n}"]})[f"d{n}"]


# -- tests ----------------------------------------------------------------------------------------------
def test_the_helpers_seal_is_the_wires():
    hdr = wire.encode(wire.Ack(5))
    opener = auth.Opener(KEY, auth.TO_PREFILL)
    opener.open([hdr], seal([hdr], KEY))  # the same format: it opens under the key
    with pytest.raises(auth.AuthError):
        opener.open([hdr], seal([hdr], WRONG_KEY))
    assert auth.TO_PREFILL == TO_PREFILL and auth.TO_DECODE == TO_DECODE


def test_claims_and_failures_without_the_key_are_refused_and_the_real_request_completes(pair, make_engine):
    """A peer without the key claims the room of a request waiting at prefill (to take its KV and
    first token) and says the room failed (to abort it): unsealed, with a zero MAC, under another
    key. Nothing is answered or applied; the real decode side gets the KV; books clean."""
    want = reference(make_engine)
    pre, dec, port = pair()
    pre.add_request(PROMPT, GREEDY, rid="p1", disagg=room(port, 1))
    claim = wire.encode(wire.Claim(1, len(PROMPT), 0, wire.tokens_crc(PROMPT), layout_of(pre)))
    fail = wire.encode(wire.Fail(1, "the attacker says so"))
    attackers = Dealers(port, 3)
    try:
        for hdr in (claim, fail):
            attackers.send([hdr], 0)  # unsealed (the wire of version 2 and before)
            attackers.send([hdr, seal([hdr], None)], 1)
            attackers.send([hdr, seal([hdr], WRONG_KEY)], 2)
        step_until([pre], lambda: stats(pre)["frames_refused"] >= 6, what="six refusals")
        for _ in range(20):
            pre.step()
        assert pre.result("p1", pop=False) is None and owners(pre) == {}  # still waiting, holding nothing
        dec.add_request(PROMPT, GREEDY, rid="d1", disagg=room(port, 1))
        res = drive([pre, dec], {id(pre): ["p1"], id(dec): ["d1"]})
        assert attackers.answers() == 0
    finally:
        attackers.close()
    assert res["d1"]["output_ids"] == want and res["p1"]["output_ids"] == want[:1]
    assert stats(pre)["frames_refused"] == 6 and stats(pre)["transfers_ok"] == 1
    assert stats(pre)["authenticated"] and stats(dec)["frames_refused"] == 0
    assert_idle_clean(pre)
    assert_idle_clean(dec)


@pytest.mark.parametrize("keyed", [True, False], ids=["key", "loopback-no-key"])
def test_garbage_is_counted_and_refused_and_a_bystander_completes(pair, make_engine, keyed):
    """Hundreds of hostile messages of every shape at the bootstrap port (some naming the bystander's
    room): each is counted exactly once, none answered, the I/O thread lives on, and the bystander's
    answer is one engine's. A frame beyond the socket's limit drops its connection inside ZMQ."""
    want = reference(make_engine)
    pre, dec, port = pair(keyed=keyed)
    pre.add_request(PROMPT, GREEDY, rid="p1", disagg=room(port, 1))
    dealers = Dealers(port)
    try:
        sent = send_hostile(port, 400, layout_of(pre), [1, 2, 3], seed=7, well_formed=keyed, dealers=dealers)
        total = sum(sent.values())
        step_until([pre], lambda: stats(pre)["frames_refused"] >= total, what=f"{total} refusals")
        giant = [b"KVL\x03" + bytes(3 * wire.MAX_HEADER_BYTES)]
        dealers.send(giant, 0)  # past the socket's limit: ZMQ drops that connection
        time.sleep(0.3)
        assert pre.core.disagg_connector.io._thread.is_alive()
        assert owners(pre) == {} and pre.result("p1", pop=False) is None
        dec.add_request(PROMPT, GREEDY, rid="d1", disagg=room(port, 1))
        res = drive([pre, dec], {id(pre): ["p1"], id(dec): ["d1"]})
        assert dealers.answers() == 0
    finally:
        dealers.close()
    assert res["d1"]["output_ids"] == want, sent
    assert stats(pre)["frames_refused"] == total, (stats(pre), sent)
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_replayed_messages_are_refused(pair, make_engine, key_file):
    """A peer with the key claims a room, takes its KV and acknowledges it; every one of those
    messages sent again (over new connections or the same one) is refused, never answered, and holds
    nothing; a real request after them completes."""
    want = reference(make_engine)
    pre, dec, port = pair()
    sealer = auth.Sealer(KEY, auth.TO_PREFILL)
    peer = Dealers(port, 1)
    recorded = []
    try:
        pre.add_request(PROMPT, GREEDY, rid="p9", disagg=room(port, 9))
        c = wire.pack(wire.Claim(9, len(PROMPT), 0, wire.tokens_crc(PROMPT), layout_of(pre)), sealer)
        peer.send(c, 0)
        recorded.append(c)
        opener = auth.Opener(KEY, auth.TO_DECODE)
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline, "the claim was never served"
            pre.step()
            if peer.socks[0].poll(5):
                msg, _ = wire.unpack(peer.socks[0].recv_multipart(), opener)
                if isinstance(msg, wire.Done):
                    break
        a = wire.pack(wire.Ack(9), sealer)
        peer.send(a, 0)
        recorded.append(a)
        step_until([pre], lambda: stats(pre)["transfers_ok"] == 1 and owners(pre) == {}, what="the ack")
        refused = stats(pre)["frames_refused"]
        replay(port, recorded, 5)
        for frames in recorded:  # and on the connection that sent them
            peer.send(frames, 0)
        step_until([pre], lambda: stats(pre)["frames_refused"] == refused + 12, what="12 refusals")
        assert peer.answers() == 0 and not pre.core.disagg_connector._claims and owners(pre) == {}
    finally:
        peer.close()
    assert real_request(pre, dec, port, 10)["output_ids"] == want
    assert stats(pre)["transfers_ok"] == 2
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_claims_beyond_the_per_peer_cap_are_refused(pair, make_engine):
    """One connection may hold at most ``max_claims_per_peer`` rooms claimed and not acknowledged:
    its next claim is answered with a failure naming the flag; another peer is not affected."""
    pre, dec, port = pair(prefill_kw={"disaggregation_max_claims_per_peer": 2})
    layout = layout_of(pre)
    sealer, opener = auth.Sealer(KEY, auth.TO_PREFILL), auth.Opener(KEY, auth.TO_DECODE)
    greedy = Dealers(port, 1)
    try:
        for r in (101, 102, 103):
            greedy.send(wire.pack(wire.Claim(r, len(PROMPT), 0, wire.tokens_crc(PROMPT), layout), sealer), 0)
        step_until([pre], lambda: greedy.socks[0].poll(0), what="the refusal")
        msg, _ = wire.unpack(greedy.socks[0].recv_multipart(), opener)
        assert isinstance(msg, wire.Fail) and msg.room == 103, msg
        assert "--disaggregation-max-claims-per-peer" in msg.reason
        assert sorted(pre.core.disagg_connector._claims) == [101, 102] and stats(pre)["frames_refused"] == 1
        # The same claim again takes nothing more (not refused); the real decode side is another peer.
        greedy.send(wire.pack(wire.Claim(101, len(PROMPT), 0, wire.tokens_crc(PROMPT), layout), sealer), 0)
        out = real_request(pre, dec, port, 104)
        assert out["output_ids"] == reference(make_engine) and stats(pre)["frames_refused"] == 1
        # The claimant gives its rooms up: they are gone.
        for r in (101, 102):
            greedy.send(wire.pack(wire.Fail(r, "done with it"), sealer), 0)
        step_until([pre], lambda: not pre.core.disagg_connector._claims, what="the claims to go")
    finally:
        greedy.close()
    assert_idle_clean(pre)
    assert_idle_clean(dec)


def test_a_room_is_not_another_peers_to_end(pair, make_engine):
    """Two peers with the key: one claims a room; the other's failure for it is refused, and the
    claimant gets the room's KV."""
    pre, _, port = pair()
    layout = layout_of(pre)
    a, b = Dealers(port, 1), Dealers(port, 1)
    sa, sb = auth.Sealer(KEY, auth.TO_PREFILL), auth.Sealer(KEY, auth.TO_PREFILL)
    opener = auth.Opener(KEY, auth.TO_DECODE)
    try:
        pre.add_request(PROMPT, GREEDY, rid="p5", disagg=room(port, 5))
        a.send(wire.pack(wire.Claim(5, len(PROMPT), 0, wire.tokens_crc(PROMPT), layout), sa), 0)
        step_until([pre], lambda: 5 in pre.core.disagg_connector._claims, what="the claim")
        b.send(wire.pack(wire.Fail(5, "not mine to end"), sb), 0)
        step_until([pre], lambda: stats(pre)["frames_refused"] == 1, what="the refusal")
        deadline = time.monotonic() + 20
        while True:  # the claimant gets the room's KV and first token
            assert time.monotonic() < deadline, "the claimant never got the KV"
            pre.step()
            if a.socks[0].poll(5) and isinstance(wire.unpack(a.socks[0].recv_multipart(), opener)[0], wire.Done):
                break
        a.send(wire.pack(wire.Ack(5), sa), 0)
        step_until([pre], lambda: stats(pre)["transfers_ok"] == 1 and pre.result("p5", pop=False), what="the ack")
        assert pre.result("p5")["output_ids"] == reference(make_engine)[:1] and b.answers() == 0
    finally:
        a.close()
        b.close()
    assert_idle_clean(pre)


def test_a_claimant_that_never_acknowledges_is_released_at_the_timeout(pair):
    """A peer that claims, takes the KV and claims the room again and again without acknowledging it:
    the KV is sent once (a claim again restarts neither the transfer nor the timeout), and the pages
    are released at the bootstrap timeout through the one release path."""
    pre, _, port = pair(prefill_kw={"disaggregation_bootstrap_timeout_s": 1.0})
    layout = layout_of(pre)
    sealer, opener = auth.Sealer(KEY, auth.TO_PREFILL), auth.Opener(KEY, auth.TO_DECODE)
    peer = Dealers(port, 1)
    try:
        pre.add_request(PROMPT, GREEDY, rid="p3", disagg=room(port, 3))
        claim = wire.Claim(3, len(PROMPT), 0, wire.tokens_crc(PROMPT), layout)
        peer.send(wire.pack(claim, sealer), 0)
        step_until([pre], lambda: stats(pre)["kv_frames"] == 1 and owners(pre), what="the KV sent")
        assert owners(pre) == {"req p3 [kv sending]": 3}
        t0 = time.monotonic()
        while owners(pre) and time.monotonic() - t0 < 4.0:
            peer.send(wire.pack(claim, sealer), 0)
            for _ in range(10):
                pre.step()
                time.sleep(0.005)
        held = time.monotonic() - t0
        assert owners(pre) == {}, f"still held after {held:.1f}s of claims"
        assert held < 2.5 and stats(pre)["kv_frames"] == 1 and stats(pre)["transfers_timed_out"] == 1
        answers = []
        while peer.socks[0].poll(50):
            answers.append(wire.unpack(peer.socks[0].recv_multipart(), opener)[0])
        assert [type(m).__name__ for m in answers].count("Done") == 1, answers
        assert isinstance(answers[-1], wire.Fail) and "timed out" in answers[-1].reason
    finally:
        peer.close()
    assert pre.result("p3")["output_ids"]
    assert_idle_clean(pre)


def test_kv_from_a_peer_without_the_key_is_never_written(pair):
    """A prefill server at an allowed address that does not hold the key answers decode's claim with
    KV and a first token (unsealed, zero MAC, another key): decode refuses each, writes nothing,
    and the request ends at its timeout; books clean, nothing cached."""
    pre, dec, port = pair(decode_kw={"disaggregation_waiting_timeout_s": 2.0})
    pre.core.disagg_connector.close()  # an impostor takes the prefill server's port
    time.sleep(0.1)
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(f"tcp://127.0.0.1:{port}")
    try:
        dec.add_request(PROMPT, GREEDY, rid="d1", disagg=room(port, 1))
        step_until([dec], lambda: rogue.poll(0), what="decode's claim")
        peer, *_ = rogue.recv_multipart()
        bpt = layout_of(dec).bytes_per_token
        data = wire.encode(wire.KVData(1, 0, len(PROMPT)))
        done = wire.encode(wire.Done(1, len(PROMPT), 42))
        payload = os.urandom(bpt * len(PROMPT))
        for key, sealed in ((None, False), (None, True), (WRONG_KEY, True)):
            msgs = ([data, payload], [done])
            for m in msgs:
                rogue.send_multipart([peer, *m, *([seal(m, key, TO_DECODE)] if sealed else [])])
        res = drive([dec], {id(dec): ["d1"]})
    finally:
        rogue.close()
    fr = res["d1"]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "timed out" in fr["message"], fr
    assert stats(dec)["frames_refused"] == 6 and stats(dec)["transfers_ok"] == 0
    assert dec.memory()["kv_cached_evictable"] == 0
    assert_idle_clean(dec)


@pytest.mark.parametrize(
    "host, port_offset",
    [("127.0.0.1", 1), ("localhost", 1), ("10.9.8.7", 0), ("169.254.169.254", 0), ("[::1]", 1), ("evil.example", 0)],
)
def test_a_decode_request_naming_a_peer_not_allowed_is_a_400_and_connects_nowhere(pair, host, port_offset):
    """SSRF: a body's bootstrap_host/port that is not an allowed prefill server is refused when the
    request is submitted (400, param bootstrap_host): no slot, no page, no connection."""
    _, dec, port = pair()
    listener = socket.socket(socket.AF_INET)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    other = listener.getsockname()[1] if port_offset else port
    try:
        with pytest.raises(ValidationError) as e:
            dec.add_request(PROMPT, GREEDY, rid="d1", disagg=DisaggParams(host, other, 1))
        assert e.value.param == "bootstrap_host" and "is not a prefill server" in e.value.message
        for _ in range(20):
            dec.step()
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing connected to the port the body named
        assert not dec.core.disagg_connector._dealers and owners(dec) == {}
        assert dec.result("d1", pop=False) is None and dec.core.scheduler.idle
    finally:
        listener.close()
    assert_idle_clean(dec)
