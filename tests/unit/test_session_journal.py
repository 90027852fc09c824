"""``--session-journal``: the front's session records mirrored to a directory follow every change of
the store (open, committed turns, rewinds, close, expiry, the cap) and a new store on the same
directory gets exactly the live records back; a torn or foreign file is dropped, never loaded. The
directory is this user's alone (0700, files 0600, tightened or refused when it exists), a session
that expired while the server was down or whose key is gone is not restored, and a session answers
only its owner's key and salt (404 otherwise, the engine's words for an unknown session)."""

from __future__ import annotations

import os
import pathlib
import stat
import time
from array import array

import pytest

from kvledger.common import FinishReason
from kvledger.errors import NotFoundError, ValidationError
from kvledger.scheduler.sessions import SessionManager, session_not_found
from kvledger.server.auth import ANONYMOUS
from kvledger.server.session_journal import JournalEntry, SessionJournal
from kvledger.server.session_store import SessionStore

EVERYONE = {ANONYMOUS}


def _records(store: SessionStore) -> dict:
    return {sid: (r.timeout_s, r.tokens.tolist()) for sid, r in store.records.items()}


def test_the_journal_mirrors_the_store_and_a_new_store_loads_it(tmp_path):
    path = str(tmp_path / "j")
    store = SessionStore(max_sessions=3, default_timeout_s=None, journal=SessionJournal(path))
    store.opened("a", None)
    store.opened("b", 30.0)
    store.opened("gone", 0.01)
    store.turn_ended({"id": "a"}, [1, 2, 3], FinishReason("stop"), [4, 5])
    store.turn_ended({"id": "a", "offset": 2}, [6], FinishReason("length"), [7])  # a rewind
    store.turn_ended({"id": "b"}, [8], FinishReason("abort", status=503), [9])  # not committed
    store.turn_ended({"id": "b"}, [10, 11], FinishReason("stop"), [12])
    time.sleep(0.02)
    store.opened("c", None)  # "gone" expired first: pruned, its file too
    store.opened("d", None)  # over the cap: the least recently used ("a": "b" committed after it)
    assert set(store.records) == {"b", "c", "d"}
    assert len(os.listdir(path)) == 3
    store.closed("c")
    again = SessionStore(max_sessions=3, default_timeout_s=None, journal=SessionJournal(path))
    assert sorted(again.load_journal(EVERYONE)) == ["b", "d"]
    assert _records(again) == _records(store) == {"b": (30.0, [10, 11, 12]), "d": (None, [])}


def test_the_committed_tokens_survive_exactly(tmp_path):
    store = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(str(tmp_path)))
    store.opened("s", None)
    store.turn_ended({"id": "s"}, list(range(1000)), FinishReason("stop"), [2**31 - 1, 0])
    store.turn_ended({"id": "s", "offset": 500}, [7], FinishReason("stop"), [8])
    again = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(str(tmp_path)))
    again.load_journal(EVERYONE)
    assert again.records["s"].tokens.tolist() == [*range(500), 7, 8]


def test_torn_and_foreign_files_are_dropped(tmp_path):
    j = SessionJournal(str(tmp_path))
    store = SessionStore(max_sessions=8, default_timeout_s=None, journal=j)
    for sid in ("ok", "torn", "renamed"):
        store.opened(sid, None)
        store.turn_ended({"id": sid}, [1, 2], FinishReason("stop"), [3])
    with open(j._file("torn"), "ab") as f:
        f.write(b"\x01")  # not a whole 4-byte token
    os.rename(j._file("renamed"), os.path.join(str(tmp_path), "0" * 64 + ".session"))
    with open(j._file("ok") + ".tmp", "wb") as f:
        f.write(b"half a write")  # a write that never finished: the previous version stands
    with open(os.path.join(str(tmp_path), "junk.session"), "wb") as f:
        f.write(b"not json\n")
    again = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(str(tmp_path)))
    assert again.load_journal(EVERYONE) == ["ok"]
    assert again.records["ok"].tokens.tolist() == [1, 2, 3]
    assert os.listdir(str(tmp_path)) == [os.path.basename(j._file("ok"))]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_journal_is_private_to_this_user(tmp_path):
    """Users' text: the directory 0700 and every file 0600 from its creation, whatever the umask."""
    old = os.umask(0o022)
    try:
        path = str(tmp_path / "j")
        j = SessionJournal(path)
        secret = j.secret()
        store = SessionStore(max_sessions=8, default_timeout_s=None, journal=j)
        store.opened("s", None)
        store.turn_ended({"id": "s"}, [1, 2], FinishReason("stop"), [3])
    finally:
        os.umask(old)
    assert _mode(path) == 0o700
    names = os.listdir(path)
    assert sorted(names) == sorted(["owner.key", os.path.basename(j._file("s"))])
    assert all(_mode(os.path.join(path, n)) == 0o600 for n in names)
    assert SessionJournal(path).secret() == secret and len(secret) == 32  # kept for the next server


def test_a_loose_journal_is_tightened_and_a_foreign_one_refused(tmp_path):
    path = str(tmp_path / "j")
    j = SessionJournal(path)
    SessionStore(max_sessions=8, default_timeout_s=None, journal=j).opened("s", None)
    os.chmod(path, 0o755)
    os.chmod(j._file("s"), 0o644)  # as kvledger before left them
    again = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(path))
    assert again.load_journal(EVERYONE) == ["s"]
    assert _mode(path) == 0o700 and _mode(j._file("s")) == 0o600
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValidationError, match="not a directory"):
        SessionJournal(str(not_a_dir))
    if os.getuid() == 0:  # (only root can give a directory to another user)
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
        with pytest.raises(ValidationError, match="belongs to another user"):
            SessionJournal(str(other))


def test_expired_sessions_and_sessions_of_removed_keys_are_not_restored(tmp_path):
    """Expiry holds across the restart (wall-clock last use in the journal), and a journal whose
    owner tag is no configured key's is dropped, its file removed."""
    j = SessionJournal(str(tmp_path))
    now = time.time()
    for sid, timeout, owner, idle in [
        ("expired", 10.0, "k1", 100.0),  # its timeout passed while the server was down
        ("alive", 1000.0, "k1", 100.0),  # 900 s left
        ("forever", None, "k1", 10**6),
        ("gone-key", None, "k2", 0.0),
    ]:
        j.write(JournalEntry(sid, timeout, owner, None, now - idle, array("i", [1, 2])))
    store = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(str(tmp_path)))
    assert sorted(store.load_journal({"k1"})) == ["alive", "forever"]
    assert sorted(os.listdir(str(tmp_path))) == sorted(os.path.basename(j._file(s)) for s in ("alive", "forever"))
    idle = time.monotonic() - store.records["alive"].last_used
    assert 99 < idle < 110  # not a fresh timeout: it expires when it would have
    [snap] = [r for r in store.snapshot() if r["id"] == "alive"]
    assert 99 < snap["idle_s"] < 110  # and the engine is told so
    assert not store.records["alive"].expired(time.monotonic())
    assert store.records["alive"].expired(time.monotonic() + 901)


class _FakeSessionKV:
    def __init__(self):
        self.by_id = {}

    def release(self, s):
        self.by_id.pop(s.id, None)


def test_the_engine_restores_a_session_with_the_time_it_had_left():
    m = SessionManager(_FakeSessionKV(), max_sessions=4, default_timeout_s=None, page_size=16)
    assert m.restore([{"id": "a", "timeout": 10.0, "tokens": [1], "idle_s": 9.5},
                      {"id": "b", "timeout": 10.0, "tokens": [1], "idle_s": 0.0}], 100, 64) == 2  # fmt: skip
    assert m.expire(time.monotonic() + 1) == ["a"]  # "a" had half a second left, "b" ten
    with pytest.raises(ValidationError):
        m.restore([{"id": "c", "timeout": 1.0, "tokens": [], "idle_s": -1}], 100, 64)


def test_a_session_answers_only_its_owner_and_salt(tmp_path):
    """Another key, another salt, or a session the store does not know: the same 404, in the same
    words as the engine's for a session that does not exist. The journal keeps tags, not the salt."""
    j = SessionJournal(str(tmp_path))
    store = SessionStore(max_sessions=8, default_timeout_s=None, journal=j)
    store.opened("s", None, "owner-a")
    unknown = session_not_found("s", "session_params.id")
    for who, salt in [("owner-b", None), ("owner-b", "pepper"), (ANONYMOUS, None)]:
        with pytest.raises(NotFoundError) as e:
            store.check("s", who, "session_params.id", salt, turn=True)
        assert e.value.to_dict() == unknown.to_dict()
    store.check("s", "owner-a", "session_params.id", "pepper", turn=True)  # the first turn binds the salt
    store.check("s", "owner-a", "session_params.id", "pepper", turn=True)
    for salt in (None, "other"):
        with pytest.raises(NotFoundError) as e:
            store.check("s", "owner-a", "session_params.id", salt, turn=True)
        assert e.value.to_dict() == unknown.to_dict()
    store.check("s", "owner-a", "session_id")  # closing: the owner's key is enough
    with pytest.raises(NotFoundError):
        store.check("s", "owner-b", "session_id")
    with pytest.raises(NotFoundError):
        store.check("never-opened", "owner-a", "session_id")
    raw = pathlib.Path(j._file("s")).read_bytes()
    assert b"pepper" not in raw and b'"owner": "owner-a"' in raw
    again = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(str(tmp_path)),
                         tag=store.tag)  # fmt: skip
    assert again.load_journal({"owner-a"}) == ["s"]
    again.check("s", "owner-a", "session_params.id", "pepper", turn=True)  # the binding survives
    with pytest.raises(NotFoundError):
        again.check("s", "owner-a", "session_params.id", None, turn=True)
