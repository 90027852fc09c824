"""Incremental detokenization: never half a UTF-8 character, never part of a stop string later cut."""

from __future__ import annotations

import itertools

import pytest

from kvledger.common import FinishReason
from kvledger.engine.detok import TextState


class ByteTok:
    """Each id is one byte; decoding replaces incomplete UTF-8 with U+FFFD (as HF tokenizers do)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stop: list[str]):
    ids = list(text.encode())
    st = TextState(ByteTok(), True, stop)
    shown = []
    for i in range(1, len(ids) + 1):
        shown.append(st.update(ids[:i], None))
    return st, ids, shown


def test_multibyte_characters_are_never_split():
    _, _ids, shown = _stream("naïve ✓ 日本", [])
    assert all("\ufffd" not in s for s in shown)
    assert all(b.startswith(a) for a, b in itertools.pairwise(shown))
    assert shown[-1] == "naïve ✓ 日本"


def test_partial_stop_string_is_held_back_then_cut():
    st, ids, shown = _stream("hello STOP there", ["STOP"])
    assert all("S" not in s for s in shown if "STOP" not in s)
    assert not any("STO" in s for s in shown)
    final = st.update(ids, FinishReason("stop", matched="STOP"))
    assert final == "hello "


def test_held_back_prefix_is_released_when_it_was_not_a_stop():
    st, ids, shown = _stream("a STAR", ["STOP"])
    assert shown[3] == "a "  # "a ST" might become "a STOP": hold "ST" back
    assert shown[-1] == "a STAR"  # "STA" cannot: released
    assert st.update(ids, FinishReason("length")) == "a STAR"


@pytest.mark.parametrize("stop_id", [10])
def test_stop_token_is_not_text(stop_id):
    st = TextState(ByteTok(), True, [])
    assert st.update([104, 105, stop_id], FinishReason("stop", matched=stop_id)) == "hi"


def test_a_stop_regex_cuts_where_its_match_ended_the_request():
    # The regex matched the text "or" with the last token; the "or" inside "for" did not match.
    st = TextState(ByteTok(), True, [])
    fr = FinishReason("stop", matched=r"\bor\b", matched_text="or")
    assert st.update(list(b"for or"), fr) == "for "
    # With a last token past the match (" or." at once) too.
    assert TextState(ByteTok(), True, []).update(list(b"for or."), fr) == "for "
