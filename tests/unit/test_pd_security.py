"""PD security without engines (issue 50, items 2 and 9): the seal on every PD message opens once,
only under its key and direction, within its time window; a server whose PD sockets leave loopback
will not start without the shared key; the bootstrap port binds loopback unless told otherwise (not
the HTTP server's --host); the prefill peers a decode server may reach parse and match as written."""

from __future__ import annotations

import argparse

import pytest

from kvledger.cli import add_engine_args, add_server_args, engine_config
from kvledger.common.disagg import DisaggParams, PrefillPeers, is_loopback
from kvledger.config import EngineConfig
from kvledger.disagg import auth, wire
from kvledger.errors import ValidationError
from kvledger.launch.validate import check_settings

KEY = b"k" * 40


def sealed(msg, key=KEY, label=auth.TO_PREFILL, sealer=None):
    return wire.pack(msg, sealer or auth.Sealer(key, label))


def test_a_seal_opens_once_under_its_key_and_direction():
    sealer = auth.Sealer(KEY, auth.TO_PREFILL)
    opener = auth.Opener(KEY, auth.TO_PREFILL)
    first, second = sealed(wire.Ack(1), sealer=sealer), sealed(wire.Ack(2), sealer=sealer)
    opener.open(first[:-1], first[-1])
    with pytest.raises(auth.AuthError, match="replayed"):
        opener.open(first[:-1], first[-1])
    opener.open(second[:-1], second[-1])
    with pytest.raises(auth.AuthError, match="replayed"):  # an older one after a newer one
        opener.open(first[:-1], first[-1])
    for other in (auth.Opener(b"x" * 40, auth.TO_PREFILL), auth.Opener(KEY, auth.TO_DECODE)):
        with pytest.raises(auth.AuthError, match="MAC"):  # another key; reflected to the other role
            other.open(second[:-1], second[-1])
    with pytest.raises(auth.AuthError, match="unauthenticated"):
        opener.open(*_split(sealed(wire.Ack(3), key=None)))


def _split(frames):
    return frames[:-1], frames[-1]


def test_every_byte_of_a_message_and_its_seal_is_covered():
    frames = wire.pack(wire.KVData(7, 0, 2), auth.Sealer(KEY, auth.TO_DECODE), b"\x01" * 32)
    flat = [bytearray(f) for f in frames]
    for i, f in enumerate(flat):
        for pos in {0, len(f) // 2, len(f) - 1}:
            bad = [bytes(g) for g in flat]
            b = bytearray(bad[i])
            b[pos] ^= 0x40
            bad[i] = bytes(b)
            with pytest.raises(auth.AuthError):
                auth.Opener(KEY, auth.TO_DECODE).open(bad[:-1], bad[-1])
    with pytest.raises(auth.AuthError):  # a frame dropped (the payload) or moved into the header
        auth.Opener(KEY, auth.TO_DECODE).open([frames[0]], frames[-1])
    with pytest.raises(auth.AuthError):
        auth.Opener(KEY, auth.TO_DECODE).open([frames[0] + frames[1]], frames[-1])
    auth.Opener(KEY, auth.TO_DECODE).open(frames[:-1], frames[-1])


def test_a_stale_or_future_seal_is_refused_and_old_sessions_are_forgotten():
    opener = auth.Opener(KEY, auth.TO_PREFILL, window_s=10.0)
    msg = sealed(wire.Ack(1))
    import time

    now = time.time()
    for skew in (-11.0, 11.0):
        with pytest.raises(auth.AuthError, match="stamped"):
            opener.open(msg[:-1], msg[-1], now=now + skew)
    opener.open(msg[:-1], msg[-1], now=now)
    assert len(opener._last) == 1
    later = sealed(wire.Ack(2))
    opener.open(later[:-1], later[-1], now=now + 5)
    opener._prune(now + 30)  # both sessions silent past the window: any frame of theirs is stale now
    assert not opener._last
    with pytest.raises(auth.AuthError, match="stamped"):
        opener.open(msg[:-1], msg[-1], now=now + 30)


def test_without_a_key_only_the_seals_size_is_checked():
    opener = auth.Opener(None, auth.TO_PREFILL)
    for key in (None, b"y" * 40):
        frames = sealed(wire.Ack(1), key=key)
        opener.open(frames[:-1], frames[-1])
    with pytest.raises(auth.AuthError, match="seal of 3 bytes"):
        opener.open([b"KVL\x03"], b"abc")


def test_unpack_opens_the_seal_before_it_parses_anything():
    garbage = [b"\xff" * 10, auth.Sealer(b"z" * 40, auth.TO_PREFILL).seal([b"\xff" * 10])]
    with pytest.raises(wire.WireError, match="MAC"):  # not "not a kvledger frame": never parsed
        wire.unpack(garbage, auth.Opener(KEY, auth.TO_PREFILL))
    ok = sealed(wire.Claim(3, 4, 0, 5, wire.Layout(1, 1, 2, "float32", 4)))
    msg, payload = wire.unpack(ok, auth.Opener(KEY, auth.TO_PREFILL))
    assert isinstance(msg, wire.Claim) and msg.room == 3 and payload is None
    with pytest.raises(wire.WireError, match="frames"):
        wire.unpack([ok[0]] * 3 + [ok[1]], auth.Opener(KEY, auth.TO_PREFILL))


def test_the_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    assert auth.load_key(None) is None
    f = tmp_path / "k"
    f.write_text("a" * 64 + "\n")
    f.chmod(0o600)
    assert auth.load_key(str(f)) == b"a" * 64
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 32"):
        auth.load_key(str(f))
    with pytest.raises(ValueError, match="cannot read"):
        auth.load_key(str(tmp_path / "missing"))
    monkeypatch.setenv(auth.ENV_KEY, "b" * 40)
    assert auth.load_key(None) == b"b" * 40


@pytest.mark.parametrize(
    "flat, exposed",
    [
        ({"disaggregation_mode": "prefill", "disaggregation_bind_host": "0.0.0.0"}, "binds 0.0.0.0"),
        ({"disaggregation_mode": "prefill", "disaggregation_bind_host": "10.0.0.1"}, "binds 10.0.0.1"),
        ({"disaggregation_mode": "decode", "disaggregation_prefill_peers": ["10.0.0.1:8998"]}, "10.0.0.1:8998"),
    ],
)
def test_pd_off_loopback_needs_the_shared_key(flat, exposed, tmp_path, monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    EngineConfig.from_flat(**flat).check()  # the values alone are fine: the key is the machine's question
    with pytest.raises(ValidationError, match=exposed) as e:
        check_settings(EngineConfig.from_flat(**flat))
    assert e.value.param == "disaggregation_auth_key_file"
    key = tmp_path / "k"
    key.write_text("c" * 64)
    check_settings(EngineConfig.from_flat(**flat, disaggregation_auth_key_file=str(key)))
    monkeypatch.setenv(auth.ENV_KEY, "d" * 64)
    check_settings(EngineConfig.from_flat(**flat))


def test_pd_on_loopback_runs_without_a_key(monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    for mode in ("prefill", "decode"):
        check_settings(EngineConfig.from_flat(disaggregation_mode=mode))
    check_settings(EngineConfig.from_flat(disaggregation_mode="decode", disaggregation_prefill_peers=["[::1]:9000"]))


def test_the_bootstrap_port_binds_loopback_whatever_the_http_host():
    """It followed --host, so ``--host 0.0.0.0`` opened the bootstrap port on every interface."""
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_engine_args(p)
    args = p.parse_args(["--host", "0.0.0.0", "--disaggregation-mode", "prefill"])
    assert engine_config(args).disagg.disaggregation_bind_host == "127.0.0.1"
    args = p.parse_args(["--disaggregation-mode", "decode", "--disaggregation-prefill-peers", "10.1.1.1:7000",
                         "localhost:7001", "--disaggregation-auth-key-file", "/dev/null"])  # fmt: skip
    with pytest.raises(ValidationError, match="0 bytes"):  # a key file that is empty
        engine_config(args)


def test_prefill_peers_match_as_written():
    peers = PrefillPeers(["10.0.0.1:8998", "Prefill-A.internal:9000", "[::1]:7000", "10.0.0.2"], 8998)
    ok = [("10.0.0.1", 8998), ("10.0.0.1", None), ("prefill-a.internal", 9000), ("::1", 7000), ("[::1]", 7000),
          ("10.0.0.2", 8998), ("2.2.2.2", 1)]  # fmt: skip
    for host, port in ok:
        assert peers.allows(DisaggParams(host, port, 1)), (host, port)
    for host, port in [("10.0.0.1", 8999), ("10.0.0.3", 8998), ("127.0.0.1", 8998), ("prefill-a", 9000)]:
        assert not peers.allows(DisaggParams(host, port, 1)), (host, port)
        with pytest.raises(ValidationError) as e:
            peers.check(DisaggParams(host, port, 1))
        assert e.value.param == "bootstrap_host"
    default = PrefillPeers(None, 8998)
    assert default.all_loopback and default.allows(DisaggParams("localhost", None, 1))
    assert not default.allows(DisaggParams("127.0.0.1", 6379, 1))  # loopback, but not the bootstrap port
    assert peers.address(DisaggParams("::1", 7000, 1)) == "[::1]:7000"
    for bad in (["10.0.0.1:x"], ["a:1:2:"], ["[::1]x"], ["h:0"]):
        with pytest.raises(ValidationError) as e:
            PrefillPeers(bad, 8998)
        assert e.value.param == "disaggregation_prefill_peers"
    assert is_loopback("127.0.0.2") and is_loopback("LOCALHOST") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
