"""The OpenAI stream writer (``openai_stream.StreamWriter``) against a generation service that runs ahead
of it: every chunk before a choice's last carries a token, each token is sent once, each choice ends
once. ``GenerationService.stream`` yields one live state that it keeps advancing, so the writer may
see several steps' tokens at once and then notices with nothing new (issue 37, item 3)."""

from __future__ import annotations

import asyncio
import json

from kvledger.common import FinishReason, Limits, RequestOutput
from kvledger.engine.detok import TextState
from kvledger.server.generation import GenState
from kvledger.server.openai_api import OpenAIServing
from kvledger.server.protocol import CompletionRequest

STEPS = [[11], [12, 13], [14], [15]]  # the tokens each engine step gives a choice


class RunAheadGen:
    """Yields the same state after each step without ever suspending: the consumer of the stream
    only runs once every step is done (the worst case of a busy event loop)."""

    def check_room(self, count: int) -> None:
        pass  # (no limit on requests in flight here)

    async def stream(self, input_ids, params, rid, disagg=None, **_):
        st = GenState(rid, params, TextState(None), len(input_ids))
        for k, toks in enumerate(STEPS):
            last = k == len(STEPS) - 1
            n = sum(map(len, STEPS[: k + 1]))
            st.add(
                RequestOutput(rid, toks, [-1.0] * len(toks), [None] * len(toks), last,
                              FinishReason("length") if last else None, len(input_ids), n, 0)
            )  # fmt: skip
            yield st


async def _chunks(body: CompletionRequest) -> list[dict]:
    serving = OpenAIServing(RunAheadGen(), "m", set(), Limits(vocab_size=100, context_length=64), None, 4)

    async def disconnected() -> bool:
        return False

    stream = await serving.completions(body, disconnected)
    lines = [line async for line in stream]
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_a_writer_behind_its_choices_sends_no_empty_chunk_and_ends_each_once():
    body = CompletionRequest(prompt=[1, 2, 3], max_tokens=5, n=2, logprobs=0, stream=True,
                             stream_options={"include_usage": True})  # fmt: skip
    chunks = asyncio.run(_chunks(body))
    tokens: dict[int, list[str]] = {0: [], 1: []}
    ends = {0: 0, 1: 0}
    for ch in chunks[:-1]:
        [c] = ch["choices"]
        tokens[c["index"]] += c["logprobs"]["tokens"]
        if c["finish_reason"] is not None:
            ends[c["index"]] += 1
        else:
            assert c["logprobs"]["tokens"], ch  # a chunk before the last carries a token
    assert ends == {0: 1, 1: 1}
    assert tokens == {i: [str(t) for step in STEPS for t in step] for i in (0, 1)}
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 10  # the prompt counted once
