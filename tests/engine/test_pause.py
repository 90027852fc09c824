"""Pause, continue and hot weight reload in the engine (issue 33 item 6; the server's routes are in
tests/integration/test_pause_server.py).

fp32 greedy on the tiny Llama: a request retract-paused mid-generation and continued gives its
uninterrupted output token for token; paused in place it keeps its slot and KV and resumes; a pause
with mode abort ends everything through the release path. A weight update gives what an engine
started on the new weights gives, flushes the prefix cache and drops sessions' KV (the next turn
recomputes its history), and a checkpoint of other shapes is refused with the old weights serving.
"""

from __future__ import annotations

import pytest

from kvledger import Engine, kernels
from kvledger.config import EngineConfig
from kvledger.engine.weights import check_reload_supported
from kvledger.errors import ConflictError, ValidationError
from kvledger.model.linear import Linear
from tests.helpers import assert_idle_clean, build_tiny_model, step_until
from tests.unit.test_loader import write_gguf

G = {"temperature": 0, "ignore_eos": True}
A, B = [5, 6, 7, 8] * 5, [9, 10, 11] * 4


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> str:
    """The tiny Llama's architecture with other random values."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama_new")), "llama", seed=7)


@pytest.fixture(scope="module")
def other_shapes(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_llama_wide")), "llama", intermediate_size=96)


def _greedy(eng, prompt, n):
    return eng.generate(input_ids=prompt, sampling_params={**G, "max_new_tokens": n})


def _outputs(eng, rid):
    return len(eng.core.scheduler.reqs[rid].output_ids)


def test_retract_pause_then_continue_gives_the_uninterrupted_output(make_engine):
    ref = make_engine()
    want = [_greedy(ref, A, 40)["output_ids"], _greedy(ref, B, 30)["output_ids"]]
    eng = make_engine()
    a = eng.add_request(A, {**G, "max_new_tokens": 40})
    b = eng.add_request(B, {**G, "max_new_tokens": 30})
    step_until(eng, lambda: _outputs(eng, a) >= 10 and _outputs(eng, b) >= 5)
    eng.pause_generation("retract")
    s = eng.core.scheduler
    m = eng.memory()
    assert not s.running and [r.rid for r in s.waiting] == [a, b]  # requeued in their order
    assert m["req_slots_free"] == m["req_slots_total"] and m["kv_private"] == 0, m
    assert m["kv_cached_evictable"] > 0, m  # their KV went to the prefix cache
    before = (_outputs(eng, a), _outputs(eng, b))
    for _ in range(10):
        eng.step()
    assert (_outputs(eng, a), _outputs(eng, b)) == before  # nothing computed while paused
    c = eng.add_request([3, 4] * 6, {**G, "max_new_tokens": 4})  # arrives while paused: waits
    eng.step()
    assert eng.core.scheduler.reqs[c].slot is None
    eng.continue_generation()
    eng.run_until_idle()
    assert eng.result(a)["output_ids"] == want[0]
    assert eng.result(b)["output_ids"] == want[1]
    assert eng.result(c)["meta_info"]["finish_reason"]["type"] == "length"


def test_in_place_pause_keeps_slots_and_kv_and_resumes(make_engine):
    want = _greedy(make_engine(), A, 40)["output_ids"]
    eng = make_engine()
    a = eng.add_request(A, {**G, "max_new_tokens": 40})
    step_until(eng, lambda: _outputs(eng, a) >= 10)
    eng.pause_generation("in_place")
    req = eng.core.scheduler.reqs[a]
    slot, pages, n = req.slot, list(req.pages), len(req.output_ids)
    for _ in range(10):
        eng.step()
    assert (req.slot, req.pages, len(req.output_ids)) == (slot, pages, n) and slot is not None
    assert eng.memory()["kv_private"] > 0
    eng.continue_generation()
    eng.run_until_idle()
    assert eng.result(a)["output_ids"] == want


def test_abort_pause_ends_every_request_through_the_release_path(make_engine):
    eng = make_engine(max_running_requests=1)
    a = eng.add_request(A, {**G, "max_new_tokens": 40})
    b = eng.add_request(B, {**G, "max_new_tokens": 8})  # queued behind a
    step_until(eng, lambda: _outputs(eng, a) >= 3)
    eng.pause_generation()  # SGLang's default mode: abort
    eng.step()
    for rid in (a, b):
        fr = eng.result(rid)["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and "pause_generation" in fr["message"], fr
    m = eng.memory()
    assert m["req_slots_free"] == m["req_slots_total"] and m["kv_private"] == 0, m
    with pytest.raises(ConflictError, match="paused"):  # offline generate would wait for ever
        _greedy(eng, A, 4)
    eng.continue_generation()
    assert _greedy(eng, A, 4)["meta_info"]["finish_reason"]["type"] == "length"


def test_bad_pause_mode_is_refused(make_engine):
    eng = make_engine()
    with pytest.raises(ValidationError, match="mode"):
        eng.pause_generation("sleep")
    assert eng.core.scheduler.paused is None


def test_update_weights_serves_the_new_weights_and_drops_cached_kv(make_engine, new_weights):
    fresh = Engine(model=new_weights, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    want = _greedy(fresh, A, 24)["output_ids"]
    eng = make_engine()
    old = _greedy(eng, A, 24)["output_ids"]
    assert old != want  # other weights, other output: the test can tell them apart
    sid = eng.open_session()
    turn1 = eng.generate(input_ids=B, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": sid})
    history = B + turn1["output_ids"]
    assert eng.sessions()[0]["kv_tokens"] > 0 and eng.memory()["kv_cached_evictable"] > 0
    ok, message, paused = eng.update_weights_from_disk(new_weights)
    assert ok and paused == 0, message
    m = eng.memory()
    assert m["kv_cached_evictable"] == 0 and m["kv_session"] == 0, m  # flushed, through the books
    assert eng.sessions()[0]["kv_tokens"] == 0 and eng.sessions()[0]["tokens"] == len(history)
    res = _greedy(eng, A, 24)
    assert res["output_ids"] == want and res["meta_info"]["cached_tokens"] == 0
    # The session's next turn recomputes its whole history with the new weights.
    turn2 = eng.generate(input_ids=[3, 4, 5], sampling_params={**G, "max_new_tokens": 8}, session_params={"id": sid})
    assert turn2["output_ids"] == _greedy(fresh, [*history, 3, 4, 5], 8)["output_ids"]
    assert turn2["meta_info"]["cached_tokens"] == 0
    eng.close_session(sid)
    assert eng.core.cfg.model.model == new_weights and eng.core.info.model_path == new_weights
    assert_idle_clean(fresh)
    fresh.shutdown()


def test_update_weights_while_retract_paused_recomputes_with_the_new_weights(make_engine, new_weights):
    fresh = Engine(model=new_weights, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    eng = make_engine()
    a = eng.add_request(A, {**G, "max_new_tokens": 30})
    step_until(eng, lambda: _outputs(eng, a) >= 10)
    eng.pause_generation("retract")
    kept = list(eng.core.scheduler.reqs[a].output_ids)
    ok, message, paused = eng.update_weights_from_disk(new_weights)
    assert ok and paused == 1, message
    assert eng.memory()["kv_cached_evictable"] == 0  # the retracted KV was the old weights'
    eng.continue_generation()
    eng.run_until_idle()
    out = eng.result(a)["output_ids"]
    # What it generated stays; the rest is the new weights' continuation of everything so far.
    assert out[: len(kept)] == kept
    assert out[len(kept) :] == _greedy(fresh, A + kept, 30 - len(kept))["output_ids"]
    assert_idle_clean(fresh)
    fresh.shutdown()


def test_a_retracted_session_turn_recomputes_its_history_on_the_new_weights(make_engine, new_weights):
    """The turn was running when paused: retracted, it holds nothing and its session keeps its KV
    (busy); the update drops that KV too, and the turn, admitted again, borrows none of it."""
    fresh = Engine(model=new_weights, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    eng = make_engine()
    sid = eng.open_session()
    first = eng.generate(input_ids=A, sampling_params={**G, "max_new_tokens": 20}, session_params={"id": sid})
    history = A + first["output_ids"]
    rid = eng.add_request(B, {**G, "max_new_tokens": 24}, session_params={"id": sid})
    step_until(eng, lambda: _outputs(eng, rid) >= 5)
    eng.pause_generation("retract")
    kept = list(eng.core.scheduler.reqs[rid].output_ids)
    assert eng.sessions()[0]["busy_rid"] == rid and eng.sessions()[0]["kv_tokens"] > 0
    ok, message, paused = eng.update_weights_from_disk(new_weights)
    assert ok and paused == 1, message
    assert eng.sessions()[0]["kv_tokens"] == 0 and eng.memory()["kv_session"] == 0
    eng.continue_generation()
    eng.run_until_idle()
    out = eng.result(rid)["output_ids"]
    assert out[: len(kept)] == kept
    assert out[len(kept) :] == _greedy(fresh, history + B + kept, 24 - len(kept))["output_ids"]
    assert eng.sessions()[0]["tokens"] == len(history) + len(B) + 24  # the turn completed into it
    eng.close_session(sid)
    assert_idle_clean(fresh)
    fresh.shutdown()


def test_update_weights_refusals_leave_the_old_weights_serving(make_engine, other_shapes, tmp_path):
    eng = make_engine()
    want = _greedy(eng, A, 16)["output_ids"]
    for path, fmt, needle in [
        (str(tmp_path / "missing"), None, "model not found"),
        (other_shapes, None, "intermediate_size 128 -> 96"),
        (other_shapes, "gguf", "needs a GGUF file"),
        (other_shapes, "pt", "load_format 'pt' is not supported"),
        ("", None, "non-empty"),
    ]:
        ok, message, _ = eng.update_weights_from_disk(path, fmt)
        assert not ok and needle in message, message
    with pytest.raises(ValidationError) as e:
        eng.core.control.update_weights_from_disk(other_shapes)
    assert e.value.code == "shape_mismatch" and e.value.param == "model_path"
    # Requests holding KV of the current weights: refused (409), in place or running.
    a = eng.add_request(A, {**G, "max_new_tokens": 16})
    step_until(eng, lambda: _outputs(eng, a) >= 2)
    for paused in (None, "in_place"):
        if paused:
            eng.pause_generation(paused)
        with pytest.raises(ConflictError, match="hold KV"):
            eng.core.control.update_weights_from_disk(other_shapes)
    eng.continue_generation()
    eng.run_until_idle()
    assert eng.result(a)["output_ids"] == want
    assert _greedy(eng, A, 16)["output_ids"] == want  # the old weights still answer


@pytest.mark.skipif(not kernels.load(), reason="kvledger's C++ kernels did not build here")
def test_update_weights_repacks_a_quantized_gguf_as_a_start_does(tmp_path):
    """int4 from a Q4_1 GGUF's blocks (packed for the kernel, no dense copy): an update to another
    Q4_1 file serves exactly what an engine started on that file serves."""
    paths = []
    for seed in (0, 7):
        src = build_tiny_model(str(tmp_path / f"hf{seed}"), "llama", seed=seed)
        paths.append(str(tmp_path / f"tiny{seed}-Q4_1.gguf"))
        write_gguf(src, paths[-1], "Q4_1")
    opts = dict(dtype="bfloat16", page_size=16, max_total_tokens=1024, strict_memory=True)
    fresh = Engine(model=paths[1], **opts)
    want = _greedy(fresh, A, 16)["output_ids"]
    eng = Engine(model=paths[0], **opts)
    old = _greedy(eng, A, 16)["output_ids"]
    assert old != want
    ok, message, _ = eng.update_weights_from_disk(paths[1], "gguf")
    assert ok, message
    assert eng.core.cfg.model.quantization == "int4"
    lins = [m for m in eng.core.model.net.modules() if isinstance(m, Linear)]
    assert lins and all(m.qw is not None and m.w is None for m in lins)  # packed, as at start
    assert _greedy(eng, A, 16)["output_ids"] == want
    for e in (fresh, eng):
        assert_idle_clean(e)
        e.shutdown()


def test_reload_is_refused_where_it_cannot_apply_yet():
    for flags, needle in [
        ({"tp_size": 2}, "tensor parallel"),
        ({"enable_torch_compile": True}, "torch-compile"),
    ]:
        with pytest.raises(ValidationError, match=needle):
            check_reload_supported(EngineConfig.from_flat(**flags))
    check_reload_supported(EngineConfig.from_flat())
