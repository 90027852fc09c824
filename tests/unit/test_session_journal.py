"""``--session-journal``: the front's session records mirrored to a directory follow every change of
the store (open, committed turns, rewinds, close, expiry, the cap) and a new store on the same
directory gets exactly the live records back; a torn or foreign file is dropped, never loaded."""

from __future__ import annotations

import os
import time

from kvledger.common import FinishReason
from kvledger.server.session_journal import SessionJournal
from kvledger.server.session_store import SessionStore


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
    assert sorted(again.load_journal()) == ["b", "d"]
    assert _records(again) == _records(store) == {"b": (30.0, [10, 11, 12]), "d": (None, [])}


def test_the_committed_tokens_survive_exactly(tmp_path):
    store = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(str(tmp_path)))
    store.opened("s", None)
    store.turn_ended({"id": "s"}, list(range(1000)), FinishReason("stop"), [2**31 - 1, 0])
    store.turn_ended({"id": "s", "offset": 500}, [7], FinishReason("stop"), [8])
    again = SessionStore(max_sessions=8, default_timeout_s=None, journal=SessionJournal(str(tmp_path)))
    again.load_journal()
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
    assert again.load_journal() == ["ok"]
    assert again.records["ok"].tokens.tolist() == [1, 2, 3]
    assert os.listdir(str(tmp_path)) == [os.path.basename(j._file("ok"))]
