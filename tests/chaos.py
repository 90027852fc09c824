"""Chaos against a real server: kill -9 and SIGSTOP of the engine under load with sessions open, and
floods of clients that disconnect. Shared by the short CI test (tests/integration/test_chaos.py) and
the longer script (bench/chaos.py).

What must hold after every blow: the front stays up (``/health`` 503 while the engine restarts, 200
after), requests in flight at the crash end with a 503 in the OpenAI error shape, every open session's
next turn succeeds with its whole earlier conversation as context (its prompt token count includes the
earlier turns, and its greedy output equals a plain request on the full conversation), a turn in flight
at the crash leaves its session as it was before that turn, and once idle the books balance.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class ChatSession:
    """One session as its client sees it: the conversation the engine committed so far."""

    id: str
    history: list[int] = field(default_factory=list)


async def open_session(c: httpx.AsyncClient) -> ChatSession:
    r = await c.post("/open_session", json={})
    r.raise_for_status()
    return ChatSession(r.json())


async def turn(c: httpx.AsyncClient, s: ChatSession, ids: list[int], n: int = 4) -> httpx.Response:
    """A turn; on success the session's history grows as the engine's commit rule says."""
    body = {
        "input_ids": ids,
        "sampling_params": {**GREEDY, "max_new_tokens": n},
        "session_params": {"id": s.id},
    }
    r = await c.post("/generate", json=body)
    if r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] != "abort":
        s.history = s.history + ids + r.json()["output_ids"]
    return r


async def check_context(c: httpx.AsyncClient, s: ChatSession, ids: list[int], n: int = 4) -> None:
    """The next turn sees the whole conversation: prompt tokens and output prove it."""
    before = list(s.history)
    r = await turn(c, s, ids, n)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["prompt_tokens"] == len(before) + len(ids), (meta, len(before), len(ids))
    full = await c.post(
        "/generate", json={"input_ids": before + ids, "sampling_params": {**GREEDY, "max_new_tokens": n}}
    )
    assert full.status_code == 200, full.text
    assert r.json()["output_ids"] == full.json()["output_ids"], "the session turn lost its earlier context"


async def load(
    c: httpx.AsyncClient, rng: random.Random, stop: asyncio.Event, stats: Counter, vocab: int
) -> None:
    """Plain and streamed requests until ``stop``; during a crash they get 503s, and that is fine."""
    while not stop.is_set():
        ids = [rng.randrange(3, vocab) for _ in range(rng.choice([4, 20, 60]))]
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": rng.choice([8, 40, 200]), "ignore_eos": True},
        }
        try:
            r = await c.post("/generate", json=body)
            stats[r.status_code] += 1
            if r.status_code >= 500:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
                await asyncio.sleep(0.1)
        except httpx.HTTPError as e:
            stats[type(e).__name__] += 1
            await asyncio.sleep(0.1)


async def disconnect_flood(c: httpx.AsyncClient, n: int, vocab: int, rng: random.Random) -> None:
    """``n`` streamed requests whose clients go away after the first event, all at once."""

    async def one() -> None:
        ids = [rng.randrange(3, vocab) for _ in range(rng.choice([5, 40]))]
        body = {
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        }
        try:
            async with c.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        return  # leaving the block closes the connection mid-stream
        except httpx.HTTPError:
            pass

    await asyncio.gather(*(one() for _ in range(n)))


async def engine_pid(c: httpx.AsyncClient) -> int:
    return (await c.get("/get_server_info")).json()["engine_pid"]


async def wait_health(c: httpx.AsyncClient, want: int, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if (await c.get("/health")).status_code == want:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout, f"/health never answered {want}"
        await asyncio.sleep(0.05)


async def blow(
    c: httpx.AsyncClient,
    sig: int,
    sessions: list[ChatSession],
    vocab: int,
    rng: random.Random,
    watchdog_s: float,
) -> dict:
    """One round: load and a session turn in flight, then ``sig`` to the engine; returns figures."""
    stop, stats = asyncio.Event(), Counter()
    loaders = [asyncio.create_task(load(c, rng, stop, stats, vocab)) for _ in range(4)]
    victim = sessions[0]
    before = list(victim.history)
    # A long turn (max_new_tokens within the smallest context chaos runs with, 1,024 tokens; the engine
    # cuts it to what the conversation leaves), still running when the engine is killed.
    inflight = asyncio.create_task(turn(c, victim, [rng.randrange(3, vocab) for _ in range(6)], n=1000))  # noqa: RUF006 - awaited below
    await asyncio.sleep(0.5)
    pid = await engine_pid(c)
    t0 = time.monotonic()
    os.kill(pid, sig)
    down = await wait_health(c, 503, timeout=watchdog_s + 10)
    r = await inflight
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    assert victim.history == before  # the crashed turn changed nothing
    await wait_health(c, 200, timeout=180)
    back = time.monotonic() - t0
    stop.set()
    await asyncio.gather(*loaders)
    assert await engine_pid(c) != pid
    for s in sessions:
        await check_context(c, s, [rng.randrange(3, vocab) for _ in range(3)])
    return {
        "signal": signal.Signals(sig).name,
        "pid": pid,
        "noticed_s": round(down, 2),
        "back_s": round(back, 2),
        "answers": dict(stats),
    }


async def chaos(
    url: str,
    rounds: int,
    vocab: int,
    watchdog_s: float,
    seed: int = 0,
    n_sessions: int = 3,
    flood: int = 24,
    headers: dict | None = None,
) -> list[dict]:
    """``rounds`` of (kill -9, SIGSTOP) alternately, each followed by a disconnect flood."""
    rng = random.Random(seed)
    report = []
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers or {}) as c:
        sessions = [await open_session(c) for _ in range(n_sessions)]
        for s in sessions:
            assert (
                await turn(c, s, [rng.randrange(3, vocab) for _ in range(rng.choice([5, 30]))])
            ).status_code == 200
        for i in range(rounds):
            sig = signal.SIGKILL if i % 2 == 0 else signal.SIGSTOP
            report.append(await blow(c, sig, sessions, vocab, rng, watchdog_s))
            await disconnect_flood(c, flood, vocab, rng)
        for s in sessions:
            await check_context(c, s, [5, 6, 7])
            assert (await c.post("/close_session", json={"session_id": s.id})).status_code == 200
    return report
