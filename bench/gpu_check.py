"""The checks run on a lent GPU (``--device cuda``): correctness first, then the real server, then speed.

    python bench/gpu_check.py --gguf FILE --hf-config DIR --out DIR [--device cuda] [--quick] [--only STEPS]

1. Parity: the GGUF served in fp32 on the device gives transformers' greedy tokens on the same device,
   token for token, for chat prompts in one mixed batch (chunked prefill small enough that prefill
   chunks share forwards with decodes); the ledger is audited clean once idle. The default dtype
   (bf16 on CUDA) is compared with the fp32 tokens and the agreement reported, not asserted.
2. The real server (``python -m kvledger serve --device ...``) on that GGUF: the OpenAI client's chat
   completion and stream, ugly inputs answered 4xx in the OpenAI error shape, ``/metrics``, and the
   books balanced once idle.
3. Speed on a full-size model of the default model's shape (SmolLM2-135M: the config and tokenizer
   in ``--hf-config``, random bf16 weights, since a GPU machine here cannot take the 98 MB file along):
   offline single stream, 32 and 128 streams, one 1,024-token prefill, against transformers'
   ``generate`` on the same device in the same run; then ``kvledger bench`` over HTTP.
4. ``graphs`` (issue 32, ``bench/gpu_graphs.py``): fp32 greedy parity with transformers with CUDA graphs
   on and off (and that graphs replayed), books clean, and output tok/s at 1 / 32 / 128 streams in bf16
   with graphs + overlap scheduling on vs off, with the per-step breakdown (host schedule and update,
   the forward's launch or replay on the host and its GPU time from ``torch.cuda.Event``s, sampling,
   the step) and the issue's targets (1 stream >= 500, 128 streams >= 20,000 output tok/s).

Issue 32 on a lent GPU, in one call. Here, once (the kit: the GGUF's first 4 blocks, its tokenizer,
and the wheels that machine lacks, for its python 3.12; ~55 MB, under the 64 MiB a call carries):

    python bench/gpu_check.py --make-kit bench/out/kit --wheels-python 3.12
    python bench/gpu_check.py --dry-run --only graphs      # the same steps on the CPU, small (~1 min)

then on the GPU, carrying ``bench/out/kit`` (about 5 minutes; the CUDA tests first):

    pip install -q --no-index --no-deps --target /tmp/site bench/out/kit/wheels/*.whl && export \
    KVLEDGER_CPU_KERNELS=0 PYTHONPATH=src:.:/tmp/site && timeout 240 python -m pytest -q -rs \
    tests/engine/test_device.py tests/engine/test_graph_runner.py tests/unit/test_graph_attention.py \
    tests/unit/test_sampler_device.py > $OUT/pytest.txt 2>&1; tail -3 $OUT/pytest.txt; python \
    bench/gpu_check.py --gguf bench/out/kit/smollm2-4blk.gguf --hf-config bench/out/kit/smollm2 \
    --out $OUT --only graphs 2>&1 | tail -60

Everything lands in ``OUT/gpu_check.json`` (and the server logs beside it). The GGUF given can be any
Llama GGUF; the lent machine's transfer limit (64 MiB) is why a truncated SmolLM2 (its first blocks,
the real tokenizer) is what was used there, see bench/RESULTS.md. To prepare one here:

    python bench/gpu_check.py --make-kit KIT [--blocks 4]

writes ``KIT/smollm2-4blk.gguf`` (the shipped GGUF's first blocks, every tensor as stored) and
``KIT/smollm2`` (its config and tokenizer, for ``--hf-config``); with ``--wheels-python X.Y`` also
``KIT/wheels``, the wheels the machine lacks (``KIT_WHEELS``, at this environment's versions, for that
python), installed there with ``pip install --no-index --no-deps --target`` and put on ``PYTHONPATH``
with ``src`` and the repository root; ``KVLEDGER_CPU_KERNELS=0`` skips building the CPU kernels there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from gpu_common import CHATS, build_full_model, chat_ids, rand_prompts, sync

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers / tests.server_harness

log = logging.getLogger("gpu_check")

def parity(args, res: dict) -> None:
    """fp32 on the device == transformers on the same device; bf16 agreement reported."""
    from tests.helpers import assert_idle_clean, hf_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvledger import Engine

    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = [chat_ids(tok, c) for c in CHATS]
    n = args.new_tokens
    greedy = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    eng = Engine(str(gguf), device=args.device, dtype="float32", page_size=16, chunked_prefill_size=32,
                 max_total_tokens=16384, strict_memory=True)  # fmt: skip
    ours = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
    assert_idle_clean(eng)
    eng.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    hf = hf.to(args.device).eval()
    ref = [hf_greedy(hf, p, n) for p in prompts]
    del hf
    same = [a == b for a, b in zip(ours, ref)]
    res["parity_fp32"] = {"prompts": len(prompts), "new_tokens": n, "identical": sum(same),
                          "prompt_lens": [len(p) for p in prompts]}  # fmt: skip
    log.info(
        "fp32 on %s vs transformers on %s: %d/%d identical", args.device, args.device, sum(same), len(same)
    )

    eng = Engine(str(gguf), device=args.device, page_size=16, max_total_tokens=16384, strict_memory=True)
    low = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
    dtype = str(eng.core.dtype)
    assert_idle_clean(eng)
    eng.shutdown()
    matched = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(low, ref)]
    res["default_dtype_vs_fp32"] = {"dtype": dtype, "identical": sum(m == n for m in matched),
                                    "tokens_matched_mean": sum(matched) / len(matched)}  # fmt: skip
    log.info("default dtype (%s) vs fp32: %s", dtype, res["default_dtype_vs_fp32"])
    if not all(same):
        bad = [i for i, s in enumerate(same) if not s]
        raise AssertionError(
            f"fp32 differs from transformers on prompts {bad}: {ours[bad[0]]} vs {ref[bad[0]]}"
        )


def offline_speed(args, model: str, res: dict) -> None:
    from tests.helpers import assert_idle_clean
    from transformers import AutoModelForCausalLM

    from kvledger import Engine
    from kvledger.model.attention_context import sdpa_backends

    dev = args.device
    gen = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    eng = Engine(model, device=dev, dtype="bfloat16", page_size=16, max_total_tokens=262144,
                 max_running_requests=256)  # fmt: skip
    eng.generate(input_ids=rand_prompts(4, 64, 9), sampling_params={**gen, "max_new_tokens": 8})  # warm-up
    speed: dict = {}
    levels = [1, 32] if args.quick else [1, 32, 128]
    for c in levels:
        ps = rand_prompts(c, 128, c)
        sync(dev)
        t = time.perf_counter()
        eng.generate(input_ids=ps if c > 1 else ps[0], sampling_params=gen)
        sync(dev)
        dt = time.perf_counter() - t
        speed[f"c{c}_out_tok_s"] = round(c * 128 / dt, 1)
        log.info("kvledger offline c=%d 128/128: %.1f out tok/s", c, c * 128 / dt)
    if dev.startswith("cuda"):
        # The same single stream with torch's own SDPA choice (cuDNN first on Hopper): the before figure.
        from torch.nn.attention import SDPBackend

        from kvledger.model import attention_context

        kept = attention_context.CUDA_SDPA_BACKENDS
        attention_context.CUDA_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *kept]
        try:
            sync(dev)
            t = time.perf_counter()
            eng.generate(input_ids=rand_prompts(1, 128, 555)[0], sampling_params=gen)
            sync(dev)
        finally:
            attention_context.CUDA_SDPA_BACKENDS = kept
        speed["c1_out_tok_s_torch_sdpa_choice"] = round(128 / (time.perf_counter() - t), 1)
        log.info("kvledger offline c=1 with torch's SDPA choice: %s", speed["c1_out_tok_s_torch_sdpa_choice"])
    times = []
    for i in range(3):
        p = rand_prompts(1, 1024, 100 + i)[0]
        sync(dev)
        t = time.perf_counter()
        eng.generate(input_ids=p, sampling_params={**gen, "max_new_tokens": 1})
        sync(dev)
        times.append(time.perf_counter() - t)
    speed["prefill_1024_ms"] = round(min(times) * 1e3, 1)
    log.info("kvledger prefill 1024: %.1f ms (best of 3)", min(times) * 1e3)
    speed["kv_pages"] = eng.memory()["kv_total"]
    profile_steps(eng, dev, Path(args.out) / "profile.txt")
    assert_idle_clean(eng)
    eng.shutdown()
    res["kvledger_offline"] = speed

    # transformers gets the same SDPA kernels (its own default would pay cuDNN's plans too).
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(dev).eval()
    hfs: dict = {}
    for c in levels:
        ids = torch.tensor(rand_prompts(c, 128, c), device=dev)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128, do_sample=False,
                  pad_token_id=0, eos_token_id=None)  # fmt: skip
        with torch.no_grad(), sdpa_backends(torch.device(dev)):
            hf.generate(ids[:, :16], **{**kw, "attention_mask": kw["attention_mask"][:, :16], "max_new_tokens": 4,
                                       "min_new_tokens": 4})  # fmt: skip
            sync(dev)
            t = time.perf_counter()
            hf.generate(ids, **kw)
            sync(dev)
        dt = time.perf_counter() - t
        hfs[f"c{c}_out_tok_s"] = round(c * 128 / dt, 1)
        log.info("transformers generate c=%d 128/128: %.1f out tok/s", c, c * 128 / dt)
    del hf
    res["transformers_offline"] = hfs


def profile_steps(eng, dev: str, path: Path) -> None:
    """Where a decode step's time goes: torch.profiler over 16 tokens at 1 and at 32 streams."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
    sort = "cuda_time_total" if dev.startswith("cuda") else "cpu_time_total"
    with path.open("w") as f:
        for c in (1, 32):
            ps = rand_prompts(c, 128, 7 + c)
            with profile(activities=acts) as prof:
                eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                            "ignore_eos": True})  # fmt: skip
                sync(dev)
            f.write(f"=== {c} stream(s), 128-token prompts, 16 new tokens ===\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=25) + "\n")


def ugly_inputs(url: str, m: str) -> dict:
    """Each must come back 4xx in the OpenAI error shape."""
    import httpx

    cases = {
        "model_unknown": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        "max_tokens_negative": {
            "model": m,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": -1,
        },
        "messages_not_a_list": {"model": m, "messages": "hi"},
        "temperature_string": {
            "model": m,
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": "hot",
        },
        "too_long": {"model": m, "messages": [{"role": "user", "content": "word " * 200000}]},
    }
    out = {}
    for name, body in cases.items():
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        err = (
            r.json().get("error", {})
            if r.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        out[name] = r.status_code
        assert 400 <= r.status_code < 500 and "message" in err, (name, r.status_code, r.text[:300])
    return out


def server_checks(args, res: dict) -> None:
    import openai
    from tests.server_harness import Server

    srv = Server(args.gguf, "--device", args.device, log_path=str(Path(args.out) / "server_gguf.log"))
    try:
        t = time.monotonic()
        srv.wait_healthy(300)
        startup = time.monotonic() - t
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHATS[0]}],
                                           max_tokens=24, temperature=0)  # fmt: skip
        pieces = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": CHATS[0]}], max_tokens=24, temperature=0,
                stream=True,
            )
            if c.choices
        ]  # fmt: skip
        assert "".join(pieces) == r.choices[0].message.content, (
            "".join(pieces),
            r.choices[0].message.content,
        )
        bad = ugly_inputs(srv.url, model)
        import httpx

        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        info = srv.wait_idle_clean(30)
        res["server_gguf"] = {
            "startup_s": round(startup, 1),
            "chat": r.choices[0].message.content,
            "usage": r.usage.model_dump() if r.usage else None,
            "stream_equals_nonstream": True,
            "ugly_inputs": bad,
            "metrics_lines": len(metrics.splitlines()),
            "ready_line": [ln for ln in srv.logs().splitlines() if "engine ready in" in ln][:1],
            "kv_total_pages": info["memory"]["kv_total"],
        }
        log.info("server on %s: %s", args.device, res["server_gguf"])
    finally:
        srv.stop()


def http_bench(args, model: str, res: dict) -> None:
    from tests.server_harness import Server

    srv = Server(model, "--device", args.device, log_path=str(Path(args.out) / "server_bench.log"))
    try:
        srv.wait_healthy(300)
        report = Path(args.out) / "http_bench.json"
        levels = "1,32" if args.quick else "1,32,128"
        cmd = [sys.executable, "-m", "kvledger", "bench", "--base-url", srv.url, "--tokenizer", model,
               "--concurrency", levels, "--num-prompts", "16", "--input-len", "128",
               "--output-len", "128", "--warmup", "2", "--no-progress", "--output", str(report)]  # fmt: skip
        subprocess.run(cmd, check=True, timeout=600)
        data = json.loads(report.read_text())
        res["http_bench"] = data
        srv.wait_idle_clean(30)
    finally:
        srv.stop()


# What the lent machine lacks (it has torch, transformers, numpy, pytest; it reaches no registry).
KIT_WHEELS = (
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "opentelemetry-api", "gguf", "pyzmq", "msgspec", "xgrammar", "apache-tvm-ffi", "openai", "jiter", "sniffio",
    "httpx", "httpcore", "h11", "anyio", "truststore", "prometheus-client",
)  # fmt: skip


def download_wheels(out: Path, python: str) -> None:
    """``KIT_WHEELS`` at this environment's versions, as wheels for CPython ``python`` on x86-64 Linux."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in KIT_WHEELS:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            log.warning("%s is not installed here: left out of the kit", name)
    tag = python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none",
           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(out), *pins]  # fmt: skip
    subprocess.run(cmd, check=True)


def make_kit(out: Path, blocks: int) -> None:
    """The shipped SmolLM2 GGUF cut to its first ``blocks`` blocks, and its config + tokenizer."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from kvledger.model.loader import default_model_path

    src = Path(default_model_path())
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "smollm2"
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(tok_dir)
    AutoConfig.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(tok_dir)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    dst = out / f"smollm2-{blocks}blk.gguf"
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        value = blocks if name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= blocks:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("wrote %s (%.1f MB) and %s", dst, dst.stat().st_size / 1e6, tok_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf")
    ap.add_argument("--hf-config", help="dir with config.json + tokenizer of the default model")
    ap.add_argument("--make-kit", metavar="DIR", help="write a truncated SmolLM2 GGUF + its tokenizer, exit")
    ap.add_argument("--blocks", type=int, default=4, help="--make-kit: blocks kept")
    ap.add_argument("--wheels-python", metavar="X.Y",
                    help="--make-kit: also download KIT/wheels, what the lent machine lacks, for this python")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true",
                    help="everything on the CPU, small (the graphs step through the CPU stand-in); makes a kit in "
                    "--work when --gguf/--hf-config are not given")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="bench/out/gpu")
    ap.add_argument("--work", default="/tmp/kvledger-gpu-check")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="parity,server,offline,http",
                    help="comma-separated steps: parity, server, offline, http, graphs (issue 32)")  # fmt: skip
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.make_kit:
        make_kit(Path(args.make_kit), args.blocks)
        if args.wheels_python:
            download_wheels(Path(args.make_kit) / "wheels", args.wheels_python)
        return 0
    if args.dry_run:
        args.device = "cpu"
        if not (args.gguf and args.hf_config):
            kit = Path(args.work) / "kit"
            make_kit(kit, 2)
            args.gguf, args.hf_config = str(kit / "smollm2-2blk.gguf"), str(kit / "smollm2")
    if not (args.gguf and args.hf_config):
        ap.error("--gguf and --hf-config are needed (or --make-kit DIR, or --dry-run)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    res: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    res["dry_run"] = args.dry_run
    steps = args.only.split(",")
    failures = []
    model = build_full_model(args) if {"offline", "http"} & set(steps) else None
    import gpu_graphs  # (beside this file, sharing its helpers through gpu_common.py)

    for name, fn in (("parity", lambda: parity(args, res)), ("server", lambda: server_checks(args, res)),
                     ("offline", lambda: offline_speed(args, model, res)),
                     ("http", lambda: http_bench(args, model, res)),
                     ("graphs", lambda: gpu_graphs.check(args, res))):  # fmt: skip
        if name not in steps:
            continue
        try:
            fn()
        except Exception as e:  # one failing step must not hide the others' figures
            log.exception("%s failed", name)
            failures.append(f"{name}: {type(e).__name__}: {e}"[:2000])
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    res["failures"] = failures
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "http_bench"}, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
