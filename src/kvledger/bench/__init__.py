"""``kvledger bench``: drive any OpenAI-compatible server with a workload; JSON report and PNG plot.

    kvledger bench --base-url http://127.0.0.1:30000 --workload random --input-len 128 \\
        --output-len 128 --concurrency 1,8,32 --num-prompts 32 --output out.json --plot out.png

Also ``python -m kvledger.bench``. ``bench/compare.py`` runs it against several systems in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import time
from dataclasses import asdict, fields
from typing import Any

import httpx

from .client import RunSettings, run_requests
from .report import plot, summarize, table
from .workloads import WORKLOADS, BenchRequest, WorkloadSpec, make_workload

__all__ = ["BenchRequest", "RunSettings", "WorkloadSpec", "add_bench_args", "make_workload", "run_bench"]

log = logging.getLogger("kvledger.bench")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server's root URL")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="name of the system in the report and plot")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", default=None, help="GGUF or HF dir for prompt lengths (default: SmolLM2)")
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument(
        "--num-prompts", type=int, default=32, help="requests per concurrency level (at least the level)"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--range-ratio", type=float, default=1.0, help="random: lengths uniform in [len*ratio, len]"
    )
    p.add_argument("--max-input-len", type=int, default=1024, help="sharegpt: clip prompt lengths")
    p.add_argument("--max-output-len", type=int, default=512, help="sharegpt: clip output lengths")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    p.add_argument("--question-len", type=int, default=32, help="shared-prefix: question tokens")
    p.add_argument("--concurrency", default="32", help="comma-separated levels, e.g. 1,8,32")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s, Poisson (default: all at once)"
    )
    p.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS"
    )
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output", default=None, help="write the JSON report here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--log-level", default="info")


def server_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists under /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def load_bench_tokenizer(path: str | None) -> Any:
    from ..model.loader import default_model_path, load_tokenizer

    tok = load_tokenizer(path or default_model_path())
    if tok is None:
        raise SystemExit(f"{path}: no tokenizer in this model; pass --tokenizer")
    return tok


def _from_args(cls, args: argparse.Namespace, **given):
    """A settings dataclass filled from the flags of the same name (``given`` wins)."""
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(given)
    return cls(**values)


def _levels(args: argparse.Namespace) -> list[int]:
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency takes positive integers, e.g. 1,8,32")
    if not args.request_rate > 0:
        raise SystemExit("--request-rate must be > 0 (inf: all at once)")
    if not isinstance(args.extra_body, dict):
        raise SystemExit("--extra-body must be a JSON object")
    return levels


def _run_level(args, requests: list[BenchRequest], settings: RunSettings, label: str) -> dict:
    if args.warmup:
        # As SGLang's bench: warm up with the workload's own first prompts, a few tokens out (for
        # the shared-prefix workload this also puts the shared system prompt in a prefix cache).
        warm = [BenchRequest(r.prompt, r.input_len, min(r.output_len, 4)) for r in requests[: args.warmup]]
        asyncio.run(run_requests(warm, settings, desc="warm-up"))
    level = settings.concurrency
    n = max(args.num_prompts, level)
    cpu0 = time.process_time()
    results, wall = asyncio.run(run_requests(requests[:n], settings, desc=f"{label} c={level}"))
    summary = summarize(results, wall)
    # The client shares the machine with the server it drives: what it spent is part of the figure.
    summary.update(concurrency=level, request_rate=args.request_rate, client_cpu_s=time.process_time() - cpu0)
    log.info(
        "%s c=%d: %.1f output tok/s, TTFT p50 %.0f ms, ITL p50 %.1f ms, %d failed",
        label, level, summary["output_tok_s"], summary["ttft_ms"]["p50"] or 0, summary["itl_ms"]["p50"] or 0,
        summary["failed"],
    )  # fmt: skip
    return summary


def run_bench(args: argparse.Namespace, tokenizer: Any = None) -> dict:
    """Run every concurrency level of ``args`` against one server; returns the report."""
    levels = _levels(args)
    tokenizer = tokenizer or load_bench_tokenizer(args.tokenizer)
    spec = _from_args(WorkloadSpec, args, kind=args.workload, num_prompts=max(args.num_prompts, max(levels)))
    requests = make_workload(spec, tokenizer)
    model = args.model or server_model(args.base_url, args.api_key)
    label = args.label or model
    runs = [
        _run_level(
            args,
            requests,
            _from_args(RunSettings, args, model=model, concurrency=c, timeout_s=args.timeout),
            label,
        )
        for c in levels
    ]
    report = {
        "label": label,
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "workload": asdict(spec),
        "ignore_eos": args.ignore_eos,
        "extra_body": args.extra_body,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": runs,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if args.plot:
        plot({label: runs}, args.plot, title=f"{args.workload} workload")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvledger bench", description=__doc__.splitlines()[0])
    add_bench_args(p)
    args = p.parse_args(argv)
    return cli_main(args)


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        report = run_bench(args)
    except httpx.HTTPError as e:
        raise SystemExit(f"kvledger bench: cannot reach {args.base_url}: {e}") from None
    except ValueError as e:  # a bad workload setting
        raise SystemExit(f"kvledger bench: {e}") from None
    print(table({report["label"]: report["runs"]}))
    if args.output:
        print(f"report: {args.output}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 1 if any(r["failed"] for r in report["runs"]) else 0
