"""The device setting: ``--device auto|cpu|cuda|cuda:N``.

On this machine there is no GPU, so the device path is checked two ways: the whole forward (batch
building, attention metadata, masks, page-table writes) runs on torch's ``meta`` device, where any
host tensor that slipped into it raises ("not on the expected device"); and the CUDA tests at the end
run only where torch sees a CUDA device (skipped with the reason otherwise).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from kvledger.config import EngineConfig
from kvledger.engine.page_table import PageTable
from kvledger.engine.resources import resolve_device
from kvledger.engine.runner import ModelRunner
from kvledger.errors import ValidationError
from kvledger.launch import validate
from kvledger.launch.validate import check_settings
from kvledger.memory import KVBuffer, PageWrite
from kvledger.model import LlamaModel
from kvledger.scheduler.output import ScheduledReq, SchedulerOutput

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")


def test_resolve_device():
    assert resolve_device("auto") == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("") == resolve_device("auto")
    assert resolve_device("CPU") == "cpu"
    assert check_settings(EngineConfig()) == "cpu"  # a GPU is opt-in until the CUDA path has run on one
    for bad in ("tpu", "cuda:x", "cuda:-1", "cpu:0", "mps"):
        with pytest.raises(ValidationError, match=re.escape("device must be auto | cpu | cuda | cuda:N")):
            resolve_device(bad)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
def test_cuda_without_a_device_is_refused_in_one_line():
    with pytest.raises(ValidationError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "torch sees no CUDA device" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "opts, what",
    [
        ({"tp_size": 2}, "tensor parallel"),
        ({"disaggregation_mode": "prefill"}, "PD disaggregation"),
        ({"attention_backend": "cpu"}, "cpu attention backend"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "int8/int4 weights"),
        ({"quantization": "int4"}, "int8/int4 weights"),
        ({"enable_int8_batch": True, "quantization": "int4"}, "int8 batches"),
    ],
)
def test_what_cuda_does_not_run_yet_is_refused_before_start(monkeypatch, opts, what):
    monkeypatch.setattr(validate, "resolve_device", lambda name: "cuda")
    with pytest.raises(ValidationError, match=f"CUDA device .* does not work with {what}|{what} .* does not work with CUDA"):
        check_settings(EngineConfig.from_flat(device="cuda", **opts))
    # auto settings resolve to what CUDA runs: quantization auto, attention auto, dtype auto
    assert check_settings(EngineConfig.from_flat(device="cuda")) == "cuda"


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_forward_keeps_every_tensor_on_the_model_device(tiny_loaded, page_size):
    """The runner and model on ``meta``: decodes (one and several), extends with and without a
    cached prefix, prompt positions through the LM head. A host tensor anywhere in the forward (a
    mask, an index, a position) raises here, as it would on a GPU."""
    mc = tiny_loaded.config
    dev = torch.device("meta")
    model = LlamaModel(mc, dict(tiny_loaded.weights), dtype=torch.float32, device=dev, attention="auto")
    assert model.attention == "torch"  # the CPU kernels are not offered off the CPU
    kv = KVBuffer(mc.num_layers, 64 * page_size, mc.num_kv_heads, mc.head_dim, torch.float32, dev)
    table = PageTable(4, 32, page_size, dev)
    runner = ModelRunner(model, kv, table)
    pages = lambda first, n: list(range(first, first + -(-n // page_size)))  # noqa: E731
    for decodes in ([("a", 0, 9)], [("a", 0, 9), ("d", 3, 12)]):
        writes = [PageWrite(0, 0, pages(0, 10)), PageWrite(1, 0, pages(12, 5)), PageWrite(2, 0, pages(24, 9))]
        writes.append(PageWrite(3, 0, pages(36, 13)))
        sched = SchedulerOutput(
            [ScheduledReq(rid, slot, pos, [5]) for rid, slot, pos in decodes]
            + [
                ScheduledReq("b", 1, 0, [1, 2, 3, 4, 5]),  # a prompt with nothing cached
                ScheduledReq("c", 2, 6, [7, 8, 9]),  # a chunk after a cached prefix
            ],
            writes,
        )
        table.apply(sched.page_writes)
        batch = runner.build(sched)
        for name in ("input_ids", "positions", "out_loc", "logit_index", "req_to_token"):
            assert getattr(batch, name).device == dev, name
        batch.logit_index = torch.arange(batch.num_tokens, device=dev)  # every row through the head
        logits = model.forward(batch, kv)
        assert logits.device == dev and logits.shape == (batch.num_tokens, mc.vocab_size)
    # Pooling: the pooled rows' final-norm hidden states, on the device too.
    pooled = [ScheduledReq("e", 1, 0, [1, 2, 3, 4, 5], pool_from=0), ScheduledReq("f", 2, 6, [7, 8, 9], pool_from=2)]
    batch = runner.build(SchedulerOutput(pooled, []))
    assert batch.pool_index.device == dev
    logits, hidden = model.forward_pooled(batch, kv)
    assert hidden.device == dev and hidden.shape == (6, mc.hidden_size)


# --- on a CUDA device (only where one is present) ---------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_greedy_equals_transformers_on_the_same_device(
    tiny_loaded, tiny_llama_hf, make_engine, page_size
):
    """fp32 on CUDA, mixed batches (chunked prefill sharing forwards with decodes): every request's
    greedy tokens equal transformers' on the same GPU; the ledger is clean once idle."""
    from tests.helpers import hf_greedy

    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(5 + 11 * i)] for i in range(6)]
    eng = make_engine(device="cuda", page_size=page_size, chunked_prefill_size=24)
    assert eng.core.cfg.model.device == "cuda" and eng.core.model.device.type == "cuda"
    outs = eng.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    )
    # Again, now from the prefix cache: the cached part is skipped, the rest runs as a masked extend.
    again = eng.generate(
        input_ids=prompts[3:], sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    )
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    hf = tiny_llama_hf.to("cuda")
    try:
        for p, o in zip(prompts + prompts[3:], outs + again):
            assert o["output_ids"] == hf_greedy(hf, p, 12)
    finally:
        tiny_llama_hf.to("cpu")


@needs_cuda
def test_cuda_bf16_serves_sampling_and_the_prefix_cache(make_engine):
    """bf16: a prefix-cache hit serves; a hit and a miss run the prompt through different SDPA
    kernels (flash, causal, for the miss; the rest after the cached part otherwise), whose bf16
    roundings differ, so only the first token is held equal (on an H200 the tiny model's greedy
    continuations parted at token 8 of 8); exactness is the fp32 test's. Seeded sampling on the
    same path is reproducible."""
    eng = make_engine(device="cuda", dtype="bfloat16")
    assert eng.core.cfg.model.quantization is None and eng.core.cfg.kernels.attention_backend == "torch"
    prompt = list(range(3, 60))
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    a = eng.generate(input_ids=prompt, sampling_params=greedy)
    b = eng.generate(input_ids=prompt, sampling_params=greedy)
    assert b["meta_info"]["cached_tokens"] > 0 and len(b["output_ids"]) == 8
    assert a["output_ids"][0] == b["output_ids"][0]
    seeded = {"max_new_tokens": 8, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    s1 = eng.generate(input_ids=prompt, sampling_params=seeded)
    s2 = eng.generate(input_ids=prompt, sampling_params=seeded)
    assert len(s1["output_ids"]) == 8 and s1["output_ids"] == s2["output_ids"]


@needs_cuda
def test_cuda_index_past_the_devices_is_refused():
    with pytest.raises(ValidationError, match=r"only \d+ CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@needs_cuda
def test_cuda_attention_never_builds_cudnn_plans(make_engine):
    """cuDNN's SDPA builds an execution plan per new shape, and a decode's KV length is new at every
    step (``attention_context.CUDA_SDPA_BACKENDS``): no forward of a bf16 run (a prefill, one stream, a batch
    of decodes, a cached prefix) may call it, where torch would otherwise pick it."""
    from torch.profiler import ProfilerActivity, profile

    def cudnn_kernels(prof) -> list[str]:
        return [e.key for e in prof.key_averages() if "cudnn" in e.key.lower()]

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    q = torch.randn(1, 2, 2, 16, device="cuda", dtype=torch.bfloat16)  # the tiny model's decode shape
    kv = torch.randn(1, 2, 40, 16, device="cuda", dtype=torch.bfloat16)
    with profile(activities=acts) as bare:
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv)
        torch.cuda.synchronize()
    if not cudnn_kernels(bare):
        pytest.skip(
            f"torch {torch.__version__} does not pick cuDNN attention on {torch.cuda.get_device_name()}"
        )
    eng = make_engine(device="cuda", dtype="bfloat16")
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with profile(activities=acts) as prof:
        eng.generate(input_ids=list(range(3, 40)), sampling_params=greedy)
        eng.generate(input_ids=[list(range(3, 40 + i)) for i in range(4)], sampling_params=greedy)
        torch.cuda.synchronize()
    assert any("scaled_dot_product" in e.key for e in prof.key_averages())
    assert not cudnn_kernels(prof)
