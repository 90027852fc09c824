"""Drive an OpenAI-compatible server with a workload and time every streamed token."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from .workloads import BenchRequest


@dataclass
class RequestResult:
    """Timings of one request. Times are seconds; ``itl`` holds the gaps between streamed chunks."""

    ok: bool
    input_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class RunSettings:
    """How to send the requests of one run."""

    base_url: str
    model: str
    endpoint: str = "completions"  # completions | chat
    concurrency: int = 32
    """Most requests in flight at once."""
    request_rate: float = float("inf")
    """Requests per second, Poisson arrivals; inf sends them all at once (bounded by concurrency)."""
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True
    extra_body: dict = field(default_factory=dict)
    """Merged into every request body (e.g. ``logit_bias`` for a server that refuses ``ignore_eos``)."""


def _body(req: BenchRequest, s: RunSettings) -> tuple[str, dict]:
    common = {
        "model": s.model,
        "max_tokens": req.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.ignore_eos:
        # Understood by kvledger, SGLang, vLLM and llama-server; min_tokens by vLLM.
        common.update(ignore_eos=True, min_tokens=req.output_len)
    common.update(s.extra_body)
    if s.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": req.prompt}]}
    return "/v1/completions", {**common, "prompt": req.prompt}


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return c["delta"].get("content") or ""
    return c.get("text") or ""


async def _one(client: httpx.AsyncClient, req: BenchRequest, s: RunSettings) -> RequestResult:
    path, body = _body(req, s)
    res = RequestResult(ok=False, input_len=req.input_len)
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):  # a server that fails mid-stream says so in an event
                    res.error = f"error event: {str(obj['error'])[:300]}"
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                if _chunk_text(obj):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    # Prefer the server's token counts: a chunk may carry several tokens (or none, mid-character).
    res.output_len = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        res.input_len = int(usage["prompt_tokens"])
    res.ok = chunks > 0
    if not res.ok:
        res.error = "no tokens streamed"
    return res


async def run_requests(requests: list[BenchRequest], s: RunSettings, desc: str = "") -> tuple[list, float]:
    """Send ``requests`` as ``s`` says; returns the results (in request order) and the wall time."""
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    limits = httpx.Limits(max_connections=s.concurrency + 4, max_keepalive_connections=s.concurrency + 4)
    sem = asyncio.Semaphore(s.concurrency)
    rng = random.Random(s.seed)
    bar = tqdm(total=len(requests), desc=desc or "requests", unit="req", disable=not s.progress, leave=False)

    async with httpx.AsyncClient(
        base_url=s.base_url, headers=headers, timeout=httpx.Timeout(s.timeout_s), limits=limits
    ) as client:

        async def guarded(req: BenchRequest) -> RequestResult:
            async with sem:
                r = await _one(client, req, s)
            bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(guarded(req)))
            if s.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(s.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    bar.close()
    return list(results), wall
