"""Issue 32's GPU check, the ``graphs`` step of ``bench/gpu_check.py`` (its docstring has the command).

1. Parity: the GGUF in fp32 with CUDA graphs on and with them off gives transformers' greedy tokens
   on the same device, token for token, for the chat prompts in one chunked, mixed batch; the graphs
   replayed some steps (``graph_stats``); every engine's books are audited clean once idle (the
   graphs' reserved padding page included).
2. Speed on the SmolLM2-135M shape in bf16 (random weights): 1, 32 and 128 streams of 128-token
   prompts and 128 new tokens, with CUDA graphs + overlap scheduling on, and both off; each with the
   per-step breakdown (``StepTimer``): the host's schedule and update, the forward's launch on the
   host (graph replay or eager dispatch) and its GPU time (``torch.cuda.Event``s around it), sampling
   (which waits for the GPU and copies the ids back), and the step's wall time; and issue 32's
   targets (one stream >= 500 output tok/s, 128 streams >= 20,000) reported, not asserted.

``--dry-run`` runs all of it on the CPU first, small: graphs through the CPU stand-in
(``EagerCapture``), wall-clock times only, so the script is known to work before GPU time is spent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from gpu_common import CHATS, build_full_model, chat_ids, rand_prompts, sync

log = logging.getLogger("gpu_check.graphs")

TARGETS = {"c1_out_tok_s": 500.0, "c128_out_tok_s": 20000.0}  # issue 32, SmolLM2 shape in bf16


def engine_opts(args, graphs: bool, check: bool = False) -> dict:
    """CUDA graphs and overlap scheduling both on, or both off. On the CPU (``--dry-run``) graphs go
    through the stand-in (``check``: with its fixed-shape checks, slower) and attention through the
    torch backend, as on CUDA."""
    opts: dict = {"device": args.device, "disable_overlap_schedule": not graphs}
    if args.device.startswith("cuda"):
        opts["disable_cuda_graph"] = not graphs
    else:
        from kvledger.engine.graph_capture import EagerCapture

        opts["attention_backend"] = "torch"
        if graphs:
            opts["graph_capture"] = EagerCapture(check=check)
    return opts


class StepTimer:
    """Where an engine's steps go, by wrapping its parts (bench-only; ``remove`` puts them back).

    ``schedule``/``update``: the scheduler on the host; ``replay``/``eager_forward``: the forward's
    call on the host (a graph replay with its input copy, or the eager forward's dispatch), with its
    GPU time on CUDA; ``sample``: sampling, which waits for the GPU and copies the ids back; ``step``:
    one engine step's wall time (with overlap the forward runs on its own thread meanwhile)."""

    def __init__(self, eng, device: str):
        self.cuda = device.startswith("cuda")
        self.host: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.events: list[tuple[str, object, object]] = []
        self._lock = threading.Lock()
        self._undo: list[tuple[object, str]] = []
        core = eng.core
        self._wrap(core, "step", "step")
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update", "update")
        self._wrap(core.runner, "_sample", "sample")
        self._wrap(core.runner.model, "forward", "eager_forward", gpu=True)
        if core.runner.graphs is not None:
            self._wrap(core.runner.graphs, "run", "replay", gpu=True)

    def _wrap(self, obj, name: str, key: str, gpu: bool = False) -> None:
        inner = getattr(obj, name)

        def timed(*a, **kw):
            ev = None
            if gpu and self.cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            t = time.perf_counter()
            out = inner(*a, **kw)
            dt = time.perf_counter() - t
            if ev is not None:
                ev[1].record()
            with self._lock:
                self.host[key] += dt
                self.calls[key] += 1
                if ev is not None:
                    self.events.append((key, *ev))
            return out

        setattr(obj, name, timed)
        self._undo.append((obj, name))

    def remove(self) -> None:
        for obj, name in self._undo:
            delattr(obj, name)  # the class's method shows through again
        self._undo = []

    def report(self) -> dict:
        """Per part: calls, host ms per call (and GPU ms per call where timed on CUDA)."""
        gpu: dict[str, float] = defaultdict(float)
        for key, start, end in self.events:
            end.synchronize()
            gpu[key] += start.elapsed_time(end)
        out = {}
        for key, n in self.calls.items():
            row = {"calls": n, "host_ms": round(1e3 * self.host[key] / n, 3)}
            if key in gpu:
                row["gpu_ms"] = round(gpu[key] / n, 3)
            out[key] = row
        return out


def parity(args, res: dict) -> None:
    """fp32 greedy with graphs on and off == transformers on the same device."""
    from tests.helpers import assert_idle_clean, hf_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvledger import Engine

    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    chats = CHATS[:3] if args.dry_run else CHATS
    prompts = [chat_ids(tok, c) for c in chats]
    n = 8 if args.dry_run else args.new_tokens
    greedy = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    hf = hf.to(args.device).eval()
    ref = [hf_greedy(hf, p, n) for p in prompts]
    del hf
    out: dict = {"prompts": len(prompts), "new_tokens": n}
    failures = []
    for graphs in (True, False):
        name = "graphs_on" if graphs else "graphs_off"
        eng = Engine(str(gguf), dtype="float32", page_size=16, chunked_prefill_size=32, max_total_tokens=16384,
                     strict_memory=True, **engine_opts(args, graphs, check=True))  # fmt: skip
        ours = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
        stats = eng.core.view.graph_stats()
        assert_idle_clean(eng)  # books clean, the padding page reserved and nothing else held
        eng.shutdown()
        same = [a == b for a, b in zip(ours, ref)]
        out[name] = {"identical": sum(same), "graphs": stats}
        log.info("fp32 %s vs transformers on %s: %d/%d identical; %s", name, args.device, sum(same), len(same), stats)
        if not all(same):
            bad = same.index(False)
            failures.append(f"{name}: prompt {bad} {ours[bad]} vs {ref[bad]}")
        if graphs and not (stats and stats["replays"] > 0):
            failures.append(f"{name}: no step replayed a graph ({stats})")
    res["graphs_parity_fp32"] = out
    if failures:
        raise AssertionError("; ".join(failures))


def speed(args, res: dict) -> None:
    """Output tok/s at 1/32/128 streams, graphs + overlap on vs off, each with its step breakdown."""
    from tests.helpers import assert_idle_clean

    from kvledger import Engine

    dev = args.device
    model = build_full_model(args, layers=2 if args.dry_run else None)
    levels = [1, 4] if args.dry_run else [1, 32] if args.quick else [1, 32, 128]
    new = 16 if args.dry_run else 128
    gen = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    out: dict = {"levels": levels, "prompt_len": 128, "new_tokens": new}
    for graphs in (True, False):
        name = "graphs_overlap_on" if graphs else "graphs_overlap_off"
        eng = Engine(model, dtype="bfloat16", page_size=16, max_total_tokens=262144 if dev.startswith("cuda") else 16384,
                     max_running_requests=256, **engine_opts(args, graphs))  # fmt: skip
        eng.generate(input_ids=rand_prompts(4, 64, 9), sampling_params={**gen, "max_new_tokens": 8})  # warm-up
        figures: dict = {"capture_s": (eng.core.view.graph_stats() or {}).get("capture_s")}
        for c in levels:
            ps = rand_prompts(c, 128, c)
            before = dict(eng.core.view.graph_stats() or {"replays": 0, "eager_steps": {}})
            timer = StepTimer(eng, dev)
            sync(dev)
            t = time.perf_counter()
            eng.generate(input_ids=ps, sampling_params=gen)
            sync(dev)
            dt = time.perf_counter() - t
            timer.remove()
            after = eng.core.view.graph_stats()
            row = {"out_tok_s": round(c * new / dt, 1), "seconds": round(dt, 3), "steps": timer.report()}
            if after is not None:
                row["replays"] = after["replays"] - before["replays"]
                row["eager_steps"] = {
                    k: v - before["eager_steps"].get(k, 0) for k, v in after["eager_steps"].items()
                }
            figures[f"c{c}"] = row
            log.info("%s c=%d: %.1f out tok/s; %s", name, c, c * new / dt, _line(row))
        assert_idle_clean(eng)
        eng.shutdown()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        out[name] = figures
    on = out["graphs_overlap_on"]
    out["targets"] = {
        k: {"want": v, "got": on.get(k.split("_")[0], {}).get("out_tok_s"),
            "met": (on.get(k.split("_")[0], {}).get("out_tok_s") or 0) >= v}
        for k, v in TARGETS.items()
    }  # fmt: skip
    res["graphs_speed_bf16"] = out
    print_breakdown(out)


def _line(row: dict) -> str:
    steps = row["steps"]
    n = max(steps.get("step", {}).get("calls", 1), 1)
    parts = []
    for key in ("schedule", "update", "replay", "eager_forward", "sample", "step"):
        s = steps.get(key)
        if s:
            gpu = f"/{s['gpu_ms']:.2f} gpu" if "gpu_ms" in s else ""
            parts.append(f"{key} {s['host_ms']:.2f}{gpu} ms x{s['calls']}")
    return f"{n} steps: " + ", ".join(parts)


def print_breakdown(out: dict) -> None:
    """The per-step table (ms per call: host, and GPU where timed)."""
    keys = ("schedule", "update", "replay", "eager_forward", "sample", "step")
    head = f"{'config':<20} {'streams':>7} {'tok/s':>9} " + " ".join(f"{k:>18}" for k in keys)
    print(head)
    for name in ("graphs_overlap_on", "graphs_overlap_off"):
        for c in out["levels"]:
            row = out[name][f"c{c}"]
            cells = []
            for k in keys:
                s = row["steps"].get(k)
                if not s:
                    cells.append(f"{'-':>18}")
                    continue
                gpu = f"/{s['gpu_ms']:.2f}" if "gpu_ms" in s else ""
                cells.append(f"{s['host_ms']:.2f}{gpu} x{s['calls']}".rjust(18))
            print(f"{name:<20} {c:>7} {row['out_tok_s']:>9} " + " ".join(cells))
    print("(ms per call: host[/GPU] x calls; replay/eager_forward: the forward's launch on the host and its GPU time)")


def check(args, res: dict) -> None:
    """Parity, then speed (a parity failure still lets the speed run: its figures are wanted too)."""
    err = None
    try:
        parity(args, res)
    except AssertionError as e:
        err = e
    speed(args, res)
    if err is not None:
        raise err
