"""Summaries (throughput, latency percentiles) of benchmark runs, and their plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(xs: Sequence[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(xs: Sequence[float], scale: float = 1000.0) -> dict:
    """Mean and percentiles, in milliseconds by default."""
    out: dict = {"mean": statistics.fmean(xs) * scale if xs else None}
    for p in PERCENTILES:
        v = percentile(xs, p)
        out[f"p{p}"] = None if v is None else v * scale
    return out


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """One run's figures: request throughput, input/output tok/s, TTFT / ITL / e2e (ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    wall = max(wall_s, 1e-9)
    errors = [r.error for r in results if not r.ok]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:5],
        "duration_s": wall_s,
        "request_throughput": len(ok) / wall,
        "input_tok_s": in_tokens / wall,
        "output_tok_s": out_tokens / wall,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "itl_ms": _dist([x for r in ok for x in r.itl]),
        "e2e_ms": _dist([r.e2e for r in ok]),
    }


def plot(systems: dict[str, list[dict]], path: str, title: str = "") -> None:
    """One PNG: output tok/s, TTFT p50 and ITL p50 against concurrency, a line per system.

    ``systems`` maps a label to its runs (summaries carrying a ``concurrency`` key).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    panels = [
        ("output tok/s", lambda r: r["output_tok_s"]),
        ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]),
        ("ITL p50 (ms)", lambda r: r["itl_ms"]["p50"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (name, get) in zip(axes, panels):
        for label, runs in systems.items():
            pts = sorted((r["concurrency"], get(r)) for r in runs if get(r) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        if "ms" in name:
            ax.set_yscale("log")  # one slow system would flatten every other line
        ax.set_xlabel("concurrency")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(systems: dict[str, list[dict]]) -> str:
    """A Markdown table of every run of every system."""
    head = "| system | concurrency | req/s | input tok/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | e2e p50 (ms) | failed |"
    rows = [head, "|" + "---|" * 9]

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"

    for label, runs in systems.items():
        for r in runs:
            rows.append(
                f"| {label} | {r['concurrency']} | {r['request_throughput']:.2f} | {f(r['input_tok_s'])} | "
                f"{f(r['output_tok_s'])} | {f(r['ttft_ms']['p50'])} / {f(r['ttft_ms']['p99'])} | "
                f"{f(r['itl_ms']['p50'])} / {f(r['itl_ms']['p99'])} | {f(r['e2e_ms']['p50'])} | {r['failed']} |"
            )
    return "\n".join(rows)
