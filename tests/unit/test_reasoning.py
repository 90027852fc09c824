"""The reasoning split (server/reasoning.py) as SGLang's parsers split: whole texts for each format and
mode, and every way a text can arrive in deltas (markers cut anywhere): the streamed parts only grow,
never show a marker or a piece of one, and end equal to the whole text's split."""

from __future__ import annotations

import itertools

import pytest

from kvledger.common.reasoning import REASONING_FORMATS
from kvledger.config import REASONING_PARSERS
from kvledger.server.reasoning import ReasoningParser

R1, QWEN3 = REASONING_FORMATS["deepseek-r1"], REASONING_FORMATS["qwen3"]

CASES = [
    # (format, thinking, text, reasoning, content)
    (R1, True, "Why</think>OK", "Why", "OK"),
    (R1, True, "<think>Why</think>OK", "Why", "OK"),  # the model opens it again: dropped
    (R1, True, "Why</think>\n\nOK", "Why", "\n\nOK"),  # SGLang keeps what follows the marker as is
    (R1, True, "still thinking", "still thinking", ""),  # cut off inside the reasoning: no answer
    (R1, True, "</think>OK", "", "OK"),
    (R1, True, "a</think>b</think>c", "a", "b</think>c"),  # one reasoning block: later markers are content
    (QWEN3, True, "<think>Why</think>OK", "Why", "OK"),
    (QWEN3, True, "Why</think>OK", "Why", "OK"),
    (QWEN3, True, '<think>hm<tool_call>{"name": "f"}</tool_call>', "hm", '<tool_call>{"name": "f"}</tool_call>'),
    (QWEN3, False, "OK", None, "OK"),  # enable_thinking false: no <think>, all content
    (QWEN3, False, "<think>Why</think>OK", "Why", "OK"),  # ... unless the model writes one
    (QWEN3, False, "Hi <think>Why</think>OK", "Why", "Hi OK"),
    (QWEN3, False, "a <thin b", None, "a <thin b"),
]


@pytest.mark.parametrize("fmt,thinking,text,reasoning,content", CASES)
def test_whole_texts(fmt, thinking, text, reasoning, content):
    part = ReasoningParser(fmt, thinking).split(text, final=True)
    assert (part.reasoning, part.content) == (reasoning, content)


def _stream(parser: ReasoningParser, deltas: list[str]) -> tuple[str, str]:
    """What a stream writer sends: the growth of each part after each delta, then at the end."""
    text, sent_r, sent_c = "", "", ""
    for k, d in enumerate(deltas):
        text += d
        final = k == len(deltas) - 1
        part = parser.split(text, final)
        r = part.reasoning or ""
        assert r.startswith(sent_r) and part.content.startswith(sent_c), (deltas[: k + 1], part)
        sent_r, sent_c = r, part.content
        if not final:
            for marker in ("<think>", "</think>"):  # nothing of a marker before the text tells
                assert marker not in sent_r and not any(sent_r.endswith(marker[:j]) for j in range(2, len(marker)))
    return sent_r, sent_c


@pytest.mark.parametrize("fmt,thinking,text,reasoning,content", CASES)
def test_every_two_and_three_way_cut_streams_to_the_whole_split(fmt, thinking, text, reasoning, content):
    for a, b in itertools.combinations(range(1, len(text)), 2):
        for deltas in ([text[:a], text[a:]], [text[:a], text[a:b], text[b:]]):
            assert _stream(ReasoningParser(fmt, thinking), deltas) == (reasoning or "", content), deltas
    assert _stream(ReasoningParser(fmt, thinking), list(text)) == (reasoning or "", content)  # char by char


def test_a_marker_cut_across_deltas_never_leaks():
    p = ReasoningParser(R1, True)
    assert p.split("Why</th", False).reasoning == "Why"  # held back: it may be the marker
    part = p.split("Why</think>O", False)
    assert (part.reasoning, part.content, part.closed) == ("Why", "O", True)
    assert p.split("Why</tho", False).reasoning == "Why</tho"  # it was not
    q = ReasoningParser(QWEN3, False)
    assert q.split("Hi <th", False).content == "Hi "
    assert q.split("Hi <think", False).content == "Hi " and q.split("Hi <think>W", False).reasoning == "W"


def test_every_parser_name_has_a_format():
    assert set(REASONING_PARSERS) == set(REASONING_FORMATS)
    assert QWEN3.thinking(None) and QWEN3.thinking({"enable_thinking": True})
    assert not QWEN3.thinking({"enable_thinking": False}) and R1.thinking({"enable_thinking": False})
