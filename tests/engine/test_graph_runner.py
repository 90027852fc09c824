"""Decode steps in CUDA graphs (``engine/graph_runner.py``), checked on the CPU with the capture's
stand-in (``EagerCapture``: a replay runs the captured function again on the static buffers, and
fails if it runs other ops or shapes than the capture, or reads a tensor's value on the host).

The batch sizes and their padding, the one copy of every input into the static block, the padding
rows' writes (only the reserved page), the outputs sliced back, the same tokens and logprobs as the
eager engine (fp32, many batch sizes between the buckets, rows finishing between steps, sampled and
seeded rows, grammars, overlap), the steps that run eager and why, the reserved page in the books,
and a recapture after a weight update. Every engine is audited clean (``make_engine``)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvledger.cli import add_engine_args, engine_config
from kvledger.common.sampling import SamplingParams, SamplingRow
from kvledger.config import EngineConfig
from kvledger.engine import graph_runner as gr
from kvledger.engine.graph_capture import EagerCapture, GraphCaptureError
from kvledger.engine.graph_runner import capture_sizes, graph_max_bs
from kvledger.errors import ValidationError
from kvledger.launch.validate import check_settings
from kvledger.scheduler.output import ScheduledReq, SchedulerOutput
from tests.helpers import assert_idle_clean, build_tiny_model

G = {"temperature": 0, "ignore_eos": True}


def test_capture_sizes_and_the_default_max():
    assert capture_sizes(160) == [1, 2, 4, 8, 16, 24, 32, *range(48, 161, 16)]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20] and capture_sizes(1) == [1] and capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(100)[-2:] == [96, 100]
    assert graph_max_bs(None, 256) == 160 and graph_max_bs(None, 64) == 64 and graph_max_bs(300, 512) == 300


def test_flags():
    cfg = EngineConfig.from_flat(disable_cuda_graph=True, cuda_graph_max_bs=8)
    assert cfg.kernels.disable_cuda_graph and cfg.kernels.cuda_graph_max_bs == 8
    assert EngineConfig().kernels.cuda_graph_max_bs is None and not EngineConfig().kernels.disable_cuda_graph
    with pytest.raises(ValidationError, match="cuda_graph_max_bs must be > 0"):
        check_settings(EngineConfig.from_flat(cuda_graph_max_bs=0))
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "24"]))
    assert cfg.kernels.disable_cuda_graph is True and cfg.kernels.cuda_graph_max_bs == 24
    # Graphs on CUDA unless disabled; on a CPU only with an explicit capture (the tests').
    assert gr.graphs_wanted(False, "cuda", None) and gr.graphs_wanted(False, "cuda:1", None)
    assert not gr.graphs_wanted(True, "cuda", None) and not gr.graphs_wanted(False, "cpu", None)
    assert gr.graphs_wanted(False, "cpu", EagerCapture())


class Recorder:
    """Wraps a graph runner's ``run``: per replayed step, the scheduled rows, the static block as the
    replay read it, the bucket, and the KV pool before and after."""

    def __init__(self, runner):
        self.runner, self.steps = runner, []
        self._run = runner.run
        runner.run = self.run

    def run(self, sched):
        kv = self.runner.kv_buffer
        before = (kv.k.clone(), kv.v.clone())
        out = self._run(sched)
        bs = next(s for s in self.runner.sizes if s >= len(sched.reqs))
        self.steps.append((sched, self.runner.static.clone(), bs, before, (kv.k.clone(), kv.v.clone()), out.clone()))
        return out


def _jobs(n: int = 11) -> list[tuple[list[int], dict]]:
    """Prompts of many lengths whose rows finish at different steps (batch sizes n..1 pass between the
    buckets), some sampled and seeded, some with logprobs."""
    jobs = []
    for i in range(n):
        sp: dict = {**G, "max_new_tokens": 3 + 2 * i}
        if i % 3 == 1:
            sp.update(temperature=0.8, seed=100 + i, top_p=0.9)
        if i % 4 == 2:
            sp.update(logprobs=True, top_logprobs=2)
        jobs.append(([(7 * i + j) % 240 + 5 for j in range(3 + 5 * i)], sp))
    return jobs


def _seen(results):
    out = []
    for r in results:
        m = r["meta_info"]
        lps = [m.get(k) for k in ("output_token_logprobs", "output_top_logprobs")]
        out.append((r["output_ids"], m["finish_reason"], *lps))
    return out


def _same(a, b, tol: float = 1e-4) -> bool:
    """Tokens, finish reasons and ids exactly; logprobs within ``tol``. A replay pads the batch to its
    bucket, and a float32 GEMM of 8 rows need not round as one of 5 does (on an AMD Zen 4 a top
    logprob read -4.73334 in one and -4.73335 in the other), so rounding to 4 places was no tolerance."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, tol) for x, y in zip(a, b))
    return a == b


def _run(eng, jobs):
    return _seen(eng.generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs]))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("sampling", ["host", "device"])
def test_replayed_steps_give_the_eager_outputs(make_engine, page_size, sampling):
    jobs = _jobs()
    want = _run(make_engine(page_size=page_size, sampling_backend=sampling), jobs)
    eng = make_engine(page_size=page_size, sampling_backend=sampling, graph_capture=EagerCapture(), cuda_graph_max_bs=8)
    graphs = eng.core.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8]
    rec = Recorder(graphs)
    assert _same(_run(eng, jobs), want)
    st = graphs.stats()
    assert st["replays"] == len(rec.steps) > 0
    assert st["eager_steps"]["prefill"] >= 1 and st["eager_steps"]["batch_size"] >= 1  # 11 > 8 rows
    sizes = {len(s[0].reqs) for s in rec.steps}
    assert {3, 5, 6, 7} <= sizes, sizes  # between the buckets: padded
    assert {s[2] for s in rec.steps} == {1, 2, 4, 8}


def test_static_block_padding_and_the_pad_rows_writes(make_engine):
    """Each replay read exactly the step's rows from the static block, padding past them; the KV pool
    changed at the rows' new locations and on the reserved page, nowhere else; n rows came back."""
    eng = make_engine(page_size=4, graph_capture=EagerCapture(), cuda_graph_max_bs=8)
    graphs = eng.core.runner.graphs
    rec = Recorder(graphs)
    _run(eng, _jobs(7))
    table = eng.core.runner.page_table.req_to_token
    pad_page, ps = graphs.pad_page, 4
    assert eng.core.kv_manager.reserved[0].own_pages == (pad_page,)
    assert (table[graphs.pad_row] // ps == pad_page).all()
    vocab = eng.core.model.cfg.vocab_size
    padded = 0
    for sched, static, bs, (k0, v0), (k1, v1), out in rec.steps:
        n = len(sched.reqs)
        want = [[r.token_ids[0] for r in sched.reqs], [r.start for r in sched.reqs], [r.slot for r in sched.reqs],
                [r.start + 1 for r in sched.reqs]]  # fmt: skip
        assert static[:, :n].tolist() == want
        assert static[:, n:bs].tolist() == [[0] * (bs - n), [0] * (bs - n), [graphs.pad_row] * (bs - n), [1] * (bs - n)]
        padded += bs > n
        assert out.shape == (n, vocab)
        changed = set(((k1 != k0).any(-1) | (v1 != v0).any(-1)).any(0).any(0).nonzero().flatten().tolist())
        rows_locs = {int(table[r.slot, r.start]) for r in sched.reqs}
        pad_locs = set(range(pad_page * ps, pad_page * ps + ps)) if bs > n else set()
        assert rows_locs <= changed and changed <= rows_locs | pad_locs, (changed, rows_locs, pad_locs)
    assert padded > 0


def test_outputs_equal_eager_logits_row_for_row(make_engine):
    """The replayed step's logits against the eager forward of the same step (fp32, same KV)."""
    eng = make_engine(graph_capture=EagerCapture(), cuda_graph_max_bs=16)
    runner = eng.core.runner
    graphs = runner.graphs
    checked = []
    run = graphs.run

    def both(sched):
        kv = runner.kv_buffer
        saved = (kv.k.clone(), kv.v.clone())
        got = run(sched).clone()
        kv.k.copy_(saved[0])
        kv.v.copy_(saved[1])
        batch = runner.build(sched)
        want = runner.model.forward(batch, kv)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        checked.append(len(sched.reqs))
        return run(sched)  # (leaves the pool as a replay does)

    graphs.run = both
    _run(eng, _jobs(9))
    assert len(set(checked)) >= 5, checked


def test_grammars_and_overlap_with_graphs(chat_model):
    """A JSON-schema row and a regex row beside plain ones (masks applied after the replay, by the
    sampler) and overlap scheduling: the eager engine's outputs, steps replayed."""
    from kvledger import Engine
    from kvledger.model import load_model

    loaded = load_model(chat_model)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}  # fmt: skip
    jobs = [
        ([5] * 14, {"temperature": 0, "max_new_tokens": 30, "json_schema": json.dumps(schema)}),
        ([6] * 9, {"temperature": 1.0, "seed": 2, "max_new_tokens": 30, "regex": r"[ab]{5}"}),
        ([7] * 11, {**G, "max_new_tokens": 20}),
        ([8] * 12, {"temperature": 0.9, "seed": 5, "max_new_tokens": 12, "frequency_penalty": 0.5}),
    ]
    out = []
    for kw in ({}, {"graph_capture": EagerCapture(), "disable_overlap_schedule": False}):
        eng = Engine(loaded_model=loaded, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True,
                     **kw)  # fmt: skip
        out.append(_run(eng, jobs))
        if kw:
            assert eng.core.overlap and eng.core.runner.graphs.replays > 0
        assert_idle_clean(eng)
    assert _same(out[0], out[1])


def test_eager_reasons(make_engine):
    eng = make_engine(graph_capture=EagerCapture(), cuda_graph_max_bs=4)
    g = eng.core.runner.graphs
    row = SamplingRow(SamplingParams(), 3)

    def req(**kw):
        return ScheduledReq(**{"rid": "r", "slot": 0, "start": 3, "token_ids": [9], "sampling": row, **kw})

    def reason(*reqs, connector=None, hisparse=None):
        return g.eager_reason(SchedulerOutput(list(reqs), hisparse=hisparse), connector)

    assert reason(req(), req(slot=1)) is None
    assert reason(req(), req(token_ids=[1, 2])) == gr.PREFILL
    assert reason(req(sampling=None)) == gr.PREFILL  # a one-token chunk that samples nothing
    assert reason(req(prompt_lp_targets=[4])) == gr.PREFILL
    assert reason(req(pool_from=0)) == gr.PREFILL
    assert reason(req(token_ids=[1, 2, 3], num_draft=2)) == gr.SPECULATIVE
    assert reason(req(lora="a")) == gr.LORA
    assert reason(*[req(slot=i) for i in range(5)]) == gr.BATCH_SIZE
    assert reason(req(), connector=object()) == gr.KV_CONNECTOR

    class Sparse:
        rows = (0,)

    assert reason(req(), hisparse=Sparse()) == gr.HISPARSE
    # A speculative engine's steps run eager, counted, and give its outputs.
    spec = make_engine(graph_capture=EagerCapture(), speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    plain = make_engine(speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    jobs = [([1, 2, 3, 4] * 8, {**G, "max_new_tokens": 24})]
    assert _same(_run(spec, jobs), _run(plain, jobs))
    assert spec.core.runner.graphs.eager_steps[gr.SPECULATIVE] > 0


def test_sliding_window_steps_run_eager_past_the_window(tmp_path):
    """Mistral with a window of 8: steps of sequences past it run eager (the graph's kernel attends
    every key), those before it replay; the eager engine's outputs."""
    from kvledger import Engine

    path = build_tiny_model(str(tmp_path / "mistral"), "mistral", sliding_window=8)
    jobs = [([3, 4, 5], {**G, "max_new_tokens": 12})]
    res = []
    for kw in ({}, {"graph_capture": EagerCapture()}):
        eng = Engine(model=path, dtype="float32", page_size=4, max_total_tokens=512, strict_memory=True, **kw)
        res.append(_run(eng, jobs))
        if kw:
            st = eng.core.runner.graphs.stats()
            assert st["replays"] > 0 and st["eager_steps"][gr.SLIDING_WINDOW] > 0, st
        assert_idle_clean(eng)
    assert _same(res[0], res[1])


def test_the_padding_page_in_the_books(make_engine):
    eng = make_engine(page_size=16, max_total_tokens=256, graph_capture=EagerCapture(), cuda_graph_max_bs=2)
    m = eng.memory()
    assert m["kv_reserved"] == 16 and m["kv_free"] == 256 - 16, m
    runs = [r for r in eng.core.view.page_map()["runs"] if r["kind"] == "reserved"]
    assert runs == [{"start": runs[0]["start"], "count": 1, "kind": "reserved", "owner": gr.PAD_OWNER}]
    assert eng.core.view.audit().ok
    # No request can need that page: the context is the rest of the pool.
    assert eng.core.limits.context_length == 256 - 16
    out = eng.generate(input_ids=[5] * 200, sampling_params={**G, "max_new_tokens": 40})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 40
    assert "kv_reserved" not in make_engine(page_size=16, max_total_tokens=256).memory()


def test_a_weight_update_recaptures(make_engine, tmp_path):
    from kvledger import Engine

    new = build_tiny_model(str(tmp_path / "new"), "llama", seed=5)
    fresh = Engine(model=new, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    jobs = _jobs(5)
    want = _run(fresh, jobs)
    eng = make_engine(graph_capture=EagerCapture())
    assert not _same(_run(eng, jobs), want)
    ok, message, _ = eng.update_weights_from_disk(new)
    assert ok, message
    graphs = eng.core.runner.graphs
    before = graphs.replays
    assert _same(_run(eng, jobs), want) and graphs.replays > before
    assert graphs.model is eng.core.model
    assert_idle_clean(fresh)


def test_the_stand_in_refuses_what_a_graph_cannot_hold():
    """The stand-in is a real check: a step that reads a value on the host, or whose shapes follow
    the data, is refused."""
    x = torch.arange(6.0)
    with pytest.raises(GraphCaptureError, match="_local_scalar_dense"):
        EagerCapture().capture(lambda: x * x.sum().item())
    with pytest.raises(GraphCaptureError, match="boolean mask"):
        EagerCapture().capture(lambda: x[x > 2])
    with pytest.raises(GraphCaptureError, match="nonzero"):
        EagerCapture().capture(lambda: (x > 2).nonzero())
    n = [3]
    step = EagerCapture().capture(lambda: x[: n[0]] * 2)
    step.replay()
    n[0] = 4
    with pytest.raises(GraphCaptureError, match="not fixed-shape"):
        step.replay()


def test_the_counts_reach_metrics(make_engine):
    from kvledger.server.metrics import Metrics

    eng = make_engine(graph_capture=EagerCapture(), cuda_graph_max_bs=4)
    _run(eng, _jobs(6))
    stats = eng.core.view.stats()
    g = stats["cuda_graph"]
    assert g["replays"] > 0 and g["eager_steps"]["prefill"] > 0 and g["batch_sizes"] == [1, 2, 4]
    m = Metrics()
    m.update_engine(stats)
    text = m.render().decode()
    assert f'kvledger_cuda_graph_steps{{path="replay",reason=""}} {float(g["replays"])}' in text
    assert f'kvledger_cuda_graph_steps{{path="eager",reason="prefill"}} {float(g["eager_steps"]["prefill"])}' in text
    assert 'kvledger_kv_tokens{state="reserved"} 16.0' in text
    assert make_engine().core.view.stats()["cuda_graph"] is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_outputs(make_engine, dtype):
    """On a GPU: real CUDA graphs (captured with the Triton kernel) against the same engine with
    --disable-cuda-graph: fp32 tokens and logprobs equal; bf16 greedy tokens equal at the first token
    of every request (the kernel and SDPA round bf16 differently); books clean with the reserved page."""
    jobs = _jobs()
    eng = make_engine(device="cuda", dtype=dtype)
    graphs = eng.core.runner.graphs
    assert graphs is not None and graphs.stats()["capture"] == "cuda" and graphs.attn.kernel == "triton"
    got = _run(eng, jobs)
    want = _run(make_engine(device="cuda", dtype=dtype, disable_cuda_graph=True), jobs)
    assert graphs.replays > 0 and eng.memory()["kv_reserved"] == 16
    if dtype == "float32":
        assert got == want
    else:
        assert [g[0][0] for g in got] == [w[0][0] for w in want]
