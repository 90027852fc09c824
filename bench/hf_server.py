"""A minimal OpenAI-compatible server around transformers' padded static ``generate``: the baseline.

    python bench/hf_server.py --model path/to/model.gguf --port 30001 [--dtype bfloat16]

Requests that arrive within ``--batch-window-ms`` of each other (up to ``--max-batch``) are left-padded
into one batch and generated together; the batch runs until its longest request is done, and a new
batch starts only then (static batching: no request joins a running batch). Tokens stream back per
request as they are generated. Written for the benchmark only: greedy or plain temperature sampling,
no stop strings, no logprobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import transformers
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    def emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class BatchStreamer(transformers.generation.streamers.BaseStreamer):
    """Hands each generated token of row i to job i; ends a job at its length or (unless ignored) EOS."""

    def __init__(self, jobs: list[Job], eos: set[int]):
        self.jobs = jobs
        self.eos = eos
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompts
            self.prompt_seen = True
            return
        for job, tok in zip(self.jobs, value.reshape(-1).tolist()):
            if job.done:
                continue
            if tok in self.eos and not job.ignore_eos:
                job.done = True
                job.emit(("end", "stop"))
                continue
            job.tokens.append(tok)
            job.emit(("tok", tok))
            if len(job.tokens) >= job.max_tokens:
                job.done = True
                job.emit(("end", "length"))

    def end(self) -> None:
        for job in self.jobs:
            if not job.done:
                job.done = True
                job.emit(("end", "length"))

    def all_done(self) -> bool:
        return all(j.done for j in self.jobs)


class AllDone(transformers.StoppingCriteria):
    def __init__(self, streamer: BatchStreamer):
        self.streamer = streamer

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.streamer.all_done(), dtype=torch.bool)


class Worker(threading.Thread):
    def __init__(self, model, tok, max_batch: int, window_s: float):
        super().__init__(daemon=True)
        self.model, self.tok = model, tok
        self.max_batch, self.window_s = max_batch, window_s
        self.jobs: queue.Queue[Job] = queue.Queue()
        eos = model.generation_config.eos_token_id
        self.eos = {e for e in (eos if isinstance(eos, list) else [eos]) if e is not None}

    def run(self) -> None:
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                try:
                    batch.append(self.jobs.get(timeout=max(left, 0)) if left > 0 else self.jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                self.generate(batch)
            except Exception as e:  # a bad batch must not kill the server
                for j in batch:
                    if not j.done:
                        j.done = True
                        j.emit(("error", str(e)))

    def generate(self, batch: list[Job]) -> None:
        width = max(len(j.ids) for j in batch)
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(j.ids)) + j.ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in batch])
        streamer = BatchStreamer(batch, self.eos)
        sample = any(j.temperature > 0 for j in batch)
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(j.max_tokens for j in batch),
                do_sample=sample,
                temperature=max(j.temperature for j in batch) if sample else None,
                top_p=None,
                top_k=None,
                eos_token_id=None,  # EOS is handled per request by the streamer
                pad_token_id=pad,
                streamer=streamer,
                stopping_criteria=transformers.StoppingCriteriaList([AllDone(streamer)]),
            )
        streamer.end()


def create_app(model, tok, name: str, worker: Worker) -> FastAPI:
    app = FastAPI()

    def error(msg: str, code: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error", "code": code}}, code)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if chat:
            ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=False)
        else:
            ids = tok.encode(body["prompt"], add_special_tokens=False)
        if not ids:
            return error("empty prompt")
        job = Job(
            ids=list(ids),
            max_tokens=int(body.get("max_tokens") or 16),
            ignore_eos=bool(body.get("ignore_eos")),
            temperature=float(body.get("temperature") or 0.0),
            loop=asyncio.get_running_loop(),
            out=asyncio.Queue(),
        )
        worker.jobs.put(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"

        def chunk(text: str, finish: str | None) -> dict:
            c = {"index": 0, "finish_reason": finish}
            if chat:
                c["delta"] = {"content": text} if text else {}
            else:
                c["text"] = text
            return {"id": rid, "object": obj + (".chunk" if chat else ""), "model": name, "choices": [c]}

        def usage() -> dict:
            n = len(job.tokens)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        async def events():
            sent = ""
            while True:
                kind, val = await job.out.get()
                if kind == "error":
                    yield f"data: {json.dumps({'error': {'message': val}})}\n\n"
                    break
                text = tok.decode(job.tokens, skip_special_tokens=True)
                delta, sent = text[len(sent) :], text
                if kind == "end":
                    yield f"data: {json.dumps(chunk(delta, val))}\n\n"
                    break
                if delta:
                    yield f"data: {json.dumps(chunk(delta, None))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'model': name, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        finish = "length"
        while True:
            kind, val = await job.out.get()
            if kind == "error":
                return error(val, 500)
            if kind == "end":
                finish = val
                break
        text = tok.decode(job.tokens, skip_special_tokens=True)
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": obj, "model": name, "choices": [choice], "usage": usage()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def load(path: str, dtype: str):
    kw = {"dtype": getattr(torch, dtype)}
    if path.endswith(".gguf"):
        d, f = os.path.dirname(path) or ".", os.path.basename(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, **kw)
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kw)
        tok = transformers.AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-window-ms", type=float, default=50.0)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model, tok = load(args.model, args.dtype)
    worker = Worker(model, tok, args.max_batch, args.batch_window_ms / 1000)
    worker.start()
    name = os.path.basename(args.model.rstrip("/"))
    uvicorn.run(create_app(model, tok, name, worker), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
