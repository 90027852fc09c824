"""Seeded sampling through the whole engine: a seeded request's output does not depend on what else
shares its batches (its draws come from (seed, position) alone)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_idle_clean


def test_seeded_generation_reproducible_across_batch_compositions(make_engine):
    eng = make_engine()
    sp = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    target = [9, 8, 7, 6, 5, 4]
    alone = eng.generate(input_ids=target, sampling_params=sp)["output_ids"]
    others = [[3 + i] * (5 + 11 * i) for i in range(5)]
    batch = eng.generate(
        input_ids=[*others[:2], target, *others[2:]],
        sampling_params=[{"max_new_tokens": 20, "temperature": 1.0}] * 2
        + [sp]
        + [{"max_new_tokens": 9, "temperature": 0.5}] * 3,
    )
    assert batch[2]["output_ids"] == alone
    unseeded = eng.generate(input_ids=target, sampling_params={**sp, "seed": None})["output_ids"]
    assert len(unseeded) == 16
    assert_idle_clean(eng)


def _results(eng, jobs) -> list[tuple]:
    out = eng.generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs])
    return [
        (r["output_ids"], r["meta_info"]["finish_reason"], r["meta_info"].get("output_token_logprobs"),
         r["meta_info"].get("output_top_logprobs"))
        for r in out
    ]  # fmt: skip


_JOBS = [
    ([9, 8, 7, 6, 5, 4], {"max_new_tokens": 16, "temperature": 0}),
    ([3] * 21, {"max_new_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3}),
    ([11, 12] * 9, {"max_new_tokens": 18, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}),
    ([5, 6, 7], {"max_new_tokens": 14, "temperature": 1.3, "min_p": 0.05, "seed": 7, "logprobs": True}),
    ([40 + i for i in range(30)], {"max_new_tokens": 20, "temperature": 0.8, "seed": 2**62 + 3,
                                   "repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}),
    ([2, 4, 6, 8] * 5, {"max_new_tokens": 16, "temperature": 0, "frequency_penalty": 0.7, "top_logprobs": 2}),
]  # fmt: skip


@pytest.mark.parametrize("kw", [{}, {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}])
def test_device_sampling_backend_same_outputs_as_host(make_engine, kw):
    """``--sampling-backend device`` (batched on the logits' device, here CPU tensors) gives the host
    sampler's outputs for greedy and seeded requests, with penalties, logprobs and draft verification."""
    host = make_engine(sampling_backend="host", **kw)
    dev = make_engine(sampling_backend="device", **kw)
    assert not host.core.executor.runner.on_device and dev.core.executor.runner.on_device
    assert not make_engine().core.executor.runner.on_device  # auto: host on a CPU
    assert _results(dev, _JOBS) == _results(host, _JOBS)
    # A repeated prompt with drafts: verification rows were sampled on the device path.
    rep = [([1, 2, 3, 4] * 8, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})]
    assert _results(dev, rep) == _results(host, rep)
    if kw:
        assert dev.core.scheduler.spec_totals.drafted > 0


def test_device_sampling_backend_grammars(chat_model):
    """Grammar bitmasks applied on the logits' device: JSON-schema and regex requests (greedy and
    seeded) beside plain ones give the host backend's outputs; books clean."""
    from kvledger import Engine
    from kvledger.model import load_model

    loaded = load_model(chat_model)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}  # fmt: skip
    jobs = [
        ([5] * 14, {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}),
        ([6] * 9, {"temperature": 1.0, "seed": 2, "max_new_tokens": 40, "regex": r"[ab]{5}"}),
        ([7] * 9, {"temperature": 0.7, "seed": 9, "top_p": 0.9, "max_new_tokens": 40, "json_schema": json.dumps(schema)}),
        ([8] * 12, {"temperature": 0.9, "seed": 5, "max_new_tokens": 12, "frequency_penalty": 0.5}),
    ]
    out = {}
    for backend in ("host", "device"):
        eng = Engine(loaded_model=loaded, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True,
                     sampling_backend=backend)  # fmt: skip
        out[backend] = [(r["output_ids"], r["text"]) for r in eng.generate(
            input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs])]  # fmt: skip
        assert_idle_clean(eng)
    assert out["device"] == out["host"]
    assert json.loads(out["device"][0][1])["n"] in range(100) and len(out["device"][1][1]) == 5
    assert json.loads(out["device"][2][1])["n"] in range(100)


def test_auto_sampling_backend_is_device_on_cuda_only():
    from kvledger.config import EngineConfig
    from kvledger.parallel.ranks import sampling_backend

    auto = EngineConfig()
    assert [sampling_backend(auto, d) for d in ("cpu", "cuda", "cuda:1", "meta")] == ["host", "device", "device", "host"]
    assert sampling_backend(EngineConfig.from_flat(sampling_backend="device"), "cpu") == "device"
    assert sampling_backend(EngineConfig.from_flat(sampling_backend="host"), "cuda") == "host"
