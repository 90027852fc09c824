"""Tensor parallel over torch.distributed (gloo, worker processes): fp32 greedy output of TP=2 equals
TP=1 token for token over chunked prefill, prefix cache, retraction and sessions, on a model whose
heads divide by 2 and on one whose single KV head is replicated; books clean; no process left."""

from __future__ import annotations

import pytest

from kvledger import Engine
from kvledger.errors import ModelLoadError, ValidationError
from kvledger.parallel.comm import ShmComm
from tests.helpers import assert_idle_clean, build_tiny_model
from tests.server_harness import process_alive

G = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["kv_sharded", "kv_replicated"])
def tp_model(request, tmp_path_factory) -> str:
    kv = 2 if request.param == "kv_sharded" else 1
    return build_tiny_model(
        str(tmp_path_factory.mktemp(request.param)), "llama", seed=3, num_key_value_heads=kv
    )


def _workload(eng: Engine) -> list[list[int]]:
    prompts = [[3 + i] * 20 + list(range(30, 60 + 9 * i)) for i in range(6)]
    outs = [
        o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params={**G, "max_new_tokens": 40})
    ]
    outs += [
        o["output_ids"]
        for o in eng.generate(input_ids=prompts[:3], sampling_params={**G, "max_new_tokens": 8})
    ]
    sid = eng.open_session()
    for t in ([5, 6, 7] * 8, [9] * 30):
        outs.append(
            eng.generate(input_ids=t, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": sid})[
                "output_ids"
            ]
        )
    eng.close_session(sid)
    return outs


def test_tp2_equals_tp1(tp_model):
    opts = dict(
        dtype="float32", page_size=16, max_total_tokens=400, chunked_prefill_size=32, strict_memory=True
    )
    one = Engine(model=tp_model, **opts)
    two = Engine(model=tp_model, tp_size=2, **opts)
    try:
        assert two.core.info.tp_size == 2 and len(two.core.info.tp_worker_pids) == 1
        assert isinstance(two.core.model.net.comm, ShmComm)  # one machine: shared-memory collectives
        assert _workload(two) == _workload(one)
        assert two.core.scheduler.total_retractions > 0  # the small pool retracted on both
        assert_idle_clean(two)
        assert_idle_clean(one)
    finally:
        pids = two.core.info.tp_worker_pids
        two.shutdown()
        one.shutdown()
    assert not any(process_alive(p) for p in pids)


def test_tp_sizes_that_do_not_fit_are_refused(tp_model):
    with pytest.raises(ValidationError):
        Engine(model=tp_model, tp_size=3, nnodes=2)
    with pytest.raises(ValidationError):
        Engine(model=tp_model, tp_size=2, enable_torch_compile=True)
    with pytest.raises(ModelLoadError, match="does not divide the 4 attention heads"):
        Engine(model=tp_model, tp_size=3)
