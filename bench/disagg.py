"""PD disaggregation and DP replicas on this machine, side by side in one run.

    python bench/disagg.py [--skip-http] [--num-prompts 16] [--input-len 256] [--output-len 32]

1. Transfer cost: a prefill engine and a decode engine (SmolLM2, fp32) in this process; decode claims
   the room, prefill computes the prompt (it runs only once claimed); the time from prefill's result
   to the KV in decode's pages, per token of KV, for the built-in transport and Mooncake's (if installed).
2. End to end over HTTP with `kvledger bench` (random prompts, fixed concurrency): one server; two
   replicas behind SGLang's router (`serve --dp-size 2`); a prefill + decode pair behind the router in
   PD mode. On 2 cores neither is expected to be faster than one server (the processes share the same
   two cores); the figures say what the extra hop costs.
3. A multi-turn chat (``--turns``, streamed ``/v1/chat/completions``, greedy) through the router to a PD
   pair, and the same chat against one server: per turn the prompt, ``cached_tokens``, TTFT, and the
   tokens and bytes the transfer moved (decode's ``/get_server_info``). Decode's own prefix cache keeps
   the transfer flat, not growing with the conversation.

    python bench/disagg.py --only-turns [--turns 5]

4. PD x tensor parallel (``--tp-transfer 1/1,3/1,1/3``, only this): the TP side's group copies
   (collecting every rank's heads on prefill, placing them on decode), per token of KV.

Writes bench/out/disagg.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 1. transfer cost -------------------------------------------------------------------------------------
def transfer_cost(backend: str, lengths: list[int], rounds: int) -> list[dict]:
    from kvledger import Engine
    from kvledger.common.disagg import DisaggParams
    from kvledger.model import load_model

    loaded = load_model(None)
    port = free_port()
    common = {"dtype": "float32", "page_size": 16, "max_total_tokens": 16384, "loaded_model": loaded,
              "disaggregation_transfer_backend": backend}  # fmt: skip
    pre = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **common)
    dec = Engine(disaggregation_mode="decode", disaggregation_bootstrap_port=port, **common)
    vocab = loaded.config.vocab_size
    rows = []
    room = 0
    try:
        for n in lengths:
            times = []
            for _ in range(rounds):
                room += 1
                prompt = [(room * 7919 + 31 * i) % (vocab - 10) + 5 for i in range(n)]  # no shared prefix
                d = DisaggParams("127.0.0.1", port, room)
                # Prefill runs a request only once decode has claimed its room: decode first.
                before = dec.core.disagg_connector.stats.transfers_ok
                dec.add_request(prompt, {"max_new_tokens": 1}, rid=f"d{room}", disagg=d)
                dec.step()
                pre.add_request(prompt, {"max_new_tokens": 1}, rid=f"p{room}", disagg=d)
                deadline = time.monotonic() + 60
                while pre.result(f"p{room}") is None:  # computed; its KV is sent from here on
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"prefill never ran: {pre.core.view.connector_stats()}")
                    pre.step()
                    dec.step()
                t0 = time.perf_counter()
                while dec.core.disagg_connector.stats.transfers_ok == before:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"no transfer: {dec.core.view.connector_stats()} {dec.result(f'd{room}', pop=False)}"
                        )
                    dec.step()
                    time.sleep(0.002 * (not dec.core.last_step_ran))  # as the server's loop polls
                times.append(time.perf_counter() - t0)
                dec.run_until_idle()
                dec.result(f"d{room}")
                pre.run_until_idle()
                dec.flush_cache()
                pre.flush_cache()
            best = min(times[1:] if rounds > 1 else times)  # the first round warms the sockets
            per_token = dec.core.info.kv_bytes_per_token
            rows.append({"backend": backend, "tokens": n, "ms": best * 1e3, "us_per_token": best / n * 1e6,
                         "MB_per_s": n * per_token / best / 1e6, "kv_bytes_per_token": per_token})  # fmt: skip
            print(
                f"  {backend:8s} {n:5d} tokens: {best * 1e3:7.1f} ms  {best / n * 1e6:6.1f} us/token",
                flush=True,
            )
    finally:
        for eng in (pre, dec):
            eng.shutdown()
    return rows


def transfer_cost_tp(sizes: tuple[int, int], lengths: list[int], rounds: int) -> list[dict]:
    """PD x TP (``--tp-transfer``): a prefill and a decode engine of TP sizes ``sizes`` (one process
    holds one TP group, so one side at most), prompts of ``lengths`` tokens sent to both at once and
    stepped to the end. Per prompt: the prefill side's finish -> ack (with TP, the collect step
    first) and the TP side's ``tp_copy_seconds`` (the step's broadcast of the meta, the gather to rank
    0, the copies), per token of KV."""
    from kvledger import Engine
    from kvledger.common.disagg import DisaggParams
    from kvledger.model import load_model

    loaded = load_model(None)
    port = free_port()
    common = {"dtype": "float32", "page_size": 16, "max_total_tokens": 8192, "loaded_model": loaded}
    pre = Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port, tp_size=sizes[0], **common)
    dec = Engine(disaggregation_mode="decode", disaggregation_bootstrap_port=port, tp_size=sizes[1], **common)
    vocab = loaded.config.vocab_size
    rows, room = [], 0
    try:
        for n in lengths:
            sent, copy = [], []
            for _ in range(rounds):
                room += 1
                prompt = [(room * 7919 + 31 * i) % (vocab - 10) + 5 for i in range(n)]  # no shared prefix
                d = DisaggParams("127.0.0.1", port, room)
                before = (pre.core.connector.stats.seconds,
                          sum(e.core.connector.stats.tp_copy_seconds for e in (pre, dec)))  # fmt: skip
                pre.add_request(prompt, {"max_new_tokens": 1}, rid=f"p{room}", disagg=d)
                dec.add_request(prompt, {"max_new_tokens": 1}, rid=f"d{room}", disagg=d)
                deadline = time.monotonic() + 120
                while dec.result(f"d{room}", pop=False) is None or not pre.core.scheduler.idle:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no transfer: {dec.core.view.connector_stats()}")
                    pre.step()
                    dec.step()
                dec.result(f"d{room}")
                pre.result(f"p{room}")
                sent.append(pre.core.connector.stats.seconds - before[0])
                copy.append(sum(e.core.connector.stats.tp_copy_seconds for e in (pre, dec)) - before[1])
                for eng in (pre, dec):
                    eng.run_until_idle()
                    eng.flush_cache()
            keep = slice(1, None) if rounds > 1 else slice(None)  # the first round warms up
            s, c = min(sent[keep]), min(copy[keep])
            rows.append({"sizes": f"{sizes[0]}/{sizes[1]}", "tokens": n, "send_ms": s * 1e3,
                         "tp_copy_ms": c * 1e3, "tp_copy_us_per_token": c / n * 1e6,
                         "tp_copy_MB_per_s": n * dec.core.info.kv_bytes_per_token * max(sizes) / c / 1e6 if c else 0.0})  # fmt: skip
            print(f"  prefill/decode TP {sizes[0]}/{sizes[1]} {n:5d} tokens: finish->ack {s * 1e3:7.1f} ms, "
                  f"group copies {c * 1e3:6.1f} ms ({c / n * 1e6:5.1f} us/token)", flush=True)  # fmt: skip
    finally:
        for eng in (pre, dec):
            eng.shutdown()
    return rows


# -- 2. end to end ----------------------------------------------------------------------------------------
class Procs:
    def __init__(self, logdir: Path):
        self.procs: list[subprocess.Popen] = []
        self.logdir = logdir

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs = []


def wait_up(url: str, path: str = "/v1/models", timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


SERVE = [sys.executable, "-m", "kvledger", "serve", "--log-level", "warning", "--page-size", "16"]


def router_cmd() -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port())]  # fmt: skip


def start_pd(procs: Procs, tag: str = "") -> tuple[str, str]:
    """A prefill and a decode server (half the cores each) behind SGLang's router in PD mode;
    returns (router URL, decode URL)."""
    bport, pport, dport, rport = free_port(), free_port(), free_port(), free_port()
    threads = ["--num-threads", str(max(1, (os.cpu_count() or 2) // 2))]
    procs.start(f"prefill{tag}", [*SERVE, *threads, "--port", str(pport), "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(bport)])  # fmt: skip
    procs.start(f"decode{tag}", [*SERVE, *threads, "--port", str(dport), "--disaggregation-mode", "decode",
                                 "--disaggregation-prefill-peers", f"127.0.0.1:{bport}"])  # fmt: skip
    wait_up(f"http://127.0.0.1:{pport}")
    wait_up(f"http://127.0.0.1:{dport}")
    procs.start(f"router{tag}", [*router_cmd(), "--port", str(rport), "--pd-disaggregation", "--prefill",
                                 f"http://127.0.0.1:{pport}", str(bport), "--decode", f"http://127.0.0.1:{dport}"])  # fmt: skip
    wait_up(f"http://127.0.0.1:{rport}", "/health")
    return f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{dport}"


def bench(url: str, label: str, args, out: Path) -> dict:
    path = out / f"{label}.json"
    cmd = [sys.executable, "-m", "kvledger", "bench", "--base-url", url, "--label", label,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--concurrency", str(args.concurrency),
           "--warmup", "2", "--output", str(path), "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(path.read_text())["runs"][0]


def end_to_end(args, out: Path) -> list[dict]:
    rows = []
    procs = Procs(out)
    try:
        port = free_port()
        procs.start("single", [*SERVE, "--port", str(port)])
        wait_up(f"http://127.0.0.1:{port}")
        rows.append({"system": "one server", **bench(f"http://127.0.0.1:{port}", "single", args, out)})
        procs.stop()

        port = free_port()
        procs.start("dp2", [*SERVE, "--port", str(port), "--dp-size", "2", "--router-policy", "round_robin"])
        wait_up(f"http://127.0.0.1:{port}")
        rows.append(
            {"system": "DP 2 replicas + router", **bench(f"http://127.0.0.1:{port}", "dp2", args, out)}
        )
        procs.stop()

        rurl, durl = start_pd(procs)
        rows.append(
            {"system": "PD prefill + decode + router", **bench(rurl, "pd", args, out)}
        )
        info = httpx.get(f"{durl}/get_server_info", timeout=10).json()["disaggregation"]
        rows[-1]["pd_decode_stats"] = info
    finally:
        procs.stop()
    return rows


# -- 3. a conversation through PD -------------------------------------------------------------------------
USER_TURNS = [
    "Tell me about the history of Paris in a few sentences.",
    "What are three famous museums there?",
    "Which one would you visit first, and why?",
    "How do I get there from the main train station?",
    "Summarise our conversation in one sentence.",
]


def chat_turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: its answer, TTFT (to the first content), and usage."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(c["delta"]["content"])
    return {"text": "".join(text), "ttft_ms": (ttft or 0.0) * 1e3, "usage": usage}


def conversation(url: str, turns: int, max_tokens: int, decode_url: str | None = None) -> list[dict]:
    messages: list[dict] = []
    rows = []
    for k in range(turns):
        messages.append({"role": "user", "content": USER_TURNS[k % len(USER_TURNS)]})
        before = httpx.get(decode_url + "/get_server_info", timeout=10).json()["disaggregation"] if decode_url else None
        got = chat_turn(url, messages, max_tokens)
        messages.append({"role": "assistant", "content": got["text"]})
        u = got["usage"]
        row = {"turn": k + 1, "prompt_tokens": u.get("prompt_tokens"), "ttft_ms": got["ttft_ms"],
               "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}  # fmt: skip
        if decode_url:
            after = httpx.get(decode_url + "/get_server_info", timeout=10).json()["disaggregation"]
            row["moved_tokens"] = after["tokens"] - before["tokens"]
            row["moved_bytes"] = after["bytes"] - before["bytes"]
        rows.append(row)
        print(f"  turn {k + 1}: {row}", flush=True)
    return rows


def multi_turn(args, out: Path) -> dict:
    procs = Procs(out)
    result = {}
    try:
        port = free_port()
        procs.start("single-turns", [*SERVE, "--port", str(port)])
        wait_up(f"http://127.0.0.1:{port}")
        print("one server:", flush=True)
        result["one server"] = conversation(f"http://127.0.0.1:{port}", args.turns, args.turn_tokens)
        procs.stop()

        rurl, durl = start_pd(procs, "-turns")
        print("PD through the router:", flush=True)
        result["PD"] = conversation(rurl, args.turns, args.turn_tokens, decode_url=durl)
        result["same_text"] = [r["prompt_tokens"] for r in result["PD"]] == [
            r["prompt_tokens"] for r in result["one server"]
        ]
    finally:
        procs.stop()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--turn-tokens", type=int, default=48, help="max_tokens of each chat turn")
    ap.add_argument("--only-turns", action="store_true", help="run only the multi-turn chat (3.)")
    ap.add_argument("--tp-transfer", metavar="P/D,...", default=None,
                    help="run only the PD x TP transfer cost for these prefill/decode TP sizes, e.g. 1/1,3/1,1/3")  # fmt: skip
    args = ap.parse_args()
    from kvledger.disagg.mooncake import available

    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    if args.tp_transfer:
        lengths = [int(x) for x in args.lengths.split(",")]
        rows = []
        for pair in args.tp_transfer.split(","):
            p, d = (int(x) for x in pair.split("/"))
            rows += transfer_cost_tp((p, d), lengths, args.rounds)
        (out / "disagg_tp.json").write_text(json.dumps(rows, indent=2))
        print("\n| prefill/decode TP | tokens | finish -> ack ms | group copies ms | us/token |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['sizes']} | {r['tokens']} | {r['send_ms']:.1f} | {r['tp_copy_ms']:.1f} | "
                  f"{r['tp_copy_us_per_token']:.1f} |")  # fmt: skip
        return 0
    if args.only_turns:
        turns = multi_turn(args, Path(tempfile.mkdtemp(prefix="kvledger-disagg-")))
        (out / "disagg_turns.json").write_text(json.dumps(turns, indent=2))
        print_turns(turns)
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    print("KV transfer, prefill done -> KV in decode's pages (best of rounds after the first):")
    cost = transfer_cost("tcp", lengths, args.rounds)
    if available() is None:
        cost += transfer_cost("mooncake", lengths, args.rounds)
    else:
        print(f"  mooncake: skipped ({available()})")
    logdir = Path(tempfile.mkdtemp(prefix="kvledger-disagg-"))
    e2e = [] if args.skip_http else end_to_end(args, logdir)
    turns = {} if args.skip_http else multi_turn(args, logdir)
    (out / "disagg.json").write_text(
        json.dumps({"transfer": cost, "end_to_end": e2e, "turns": turns}, indent=2, default=str)
    )
    print("\n| backend | tokens | ms | us/token | MB/s |\n|---|---|---|---|---|")
    for r in cost:
        print(
            f"| {r['backend']} | {r['tokens']} | {r['ms']:.1f} | {r['us_per_token']:.1f} | {r['MB_per_s']:.0f} |"
        )
    if e2e:
        print(
            "\n| system | output tok/s | TTFT p50 ms | ITL p50 ms | e2e p50 ms | failed |\n|---|---|---|---|---|---|"
        )
        for r in e2e:
            print(f"| {r['system']} | {r['output_tok_s']:.1f} | {r['ttft_ms']['p50']:.0f} | "
                  f"{r['itl_ms']['p50']:.0f} | {r['e2e_ms']['p50']:.0f} | {r['failed']} |")  # fmt: skip
    if turns:
        print_turns(turns)
    return 0


def print_turns(turns: dict) -> None:
    one, pd = turns["one server"], turns["PD"]
    print("\n| turn | prompt tokens | cached (one server) | cached (PD) | TTFT ms one server | TTFT ms PD "
          "| tokens moved | KB moved |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for a, b in zip(one, pd, strict=True):
        print(f"| {a['turn']} | {b['prompt_tokens']} | {a['cached_tokens']} | {b['cached_tokens']} | "
              f"{a['ttft_ms']:.0f} | {b['ttft_ms']:.0f} | {b['moved_tokens']} | {b['moved_bytes'] / 1024:.0f} |")  # fmt: skip
    print(f"same prompts on both (greedy, same text): {turns['same_text']}")


if __name__ == "__main__":
    sys.exit(main())
