"""Tensor parallel over torch.distributed (gloo, worker processes): fp32 greedy output of TP=2 equals
TP=1 token for token over chunked prefill, prefix cache, retraction and sessions, on a model whose
heads divide by 2 and on one whose single KV head is replicated; with a draft model (on rank 0) and
with torch.compile (a graph per rank, no recompiles) too; strict books every step, clean after; no
process left."""

from __future__ import annotations

import random

import pytest

from kvledger import Engine
from kvledger.comm import ShmComm
from kvledger.errors import ModelLoadError, ValidationError
from tests.helpers import assert_idle_clean, build_tiny_model
from tests.server_harness import process_alive

G = {"temperature": 0, "ignore_eos": True}
# Prefill first: the workload admits every prompt before decoding, so the pool runs out (retraction).
OPTS = dict(dtype="float32", page_size=16, max_total_tokens=400, chunked_prefill_size=32, strict_memory=True,
            interleave_prefill_tokens=0)  # fmt: skip


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
    one = Engine(model=tp_model, **OPTS)
    two = Engine(model=tp_model, tp_size=2, **OPTS)
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
    with pytest.raises(ModelLoadError, match="does not divide the 4 attention heads"):
        Engine(model=tp_model, tp_size=3)


def test_a_start_that_fails_after_the_group_formed_closes_it(tp_model):
    """A TP prefill engine whose PD bootstrap port is taken fails after its group formed and its
    model loaded: the worker rank is gone and this process left the group, so the next TP engine in
    the same process starts and serves (before, every later TP engine failed: "trying to initialize
    the default process group twice", 40 tests in one CI run)."""
    import socket

    import psutil
    import torch.distributed as dist

    from tests.server_harness import free_port

    def tp_workers() -> set[int]:
        """This process's live TP worker ranks (other children, such as torch.compile's worker pool
        from an earlier test, come and go on their own)."""
        pids = set()
        for c in psutil.Process().children(recursive=True):
            try:
                if "kvledger.parallel.worker" in " ".join(c.cmdline()) and process_alive(c.pid):
                    pids.add(c.pid)
            except psutil.Error:  # gone, or a zombie without a command line: not alive
                pass
        return pids

    assert not tp_workers()
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(ValidationError, match="cannot bind the disaggregation bootstrap port"):
            Engine(model=tp_model, tp_size=2, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                   disaggregation_bind_host="127.0.0.1", **OPTS)  # fmt: skip
    assert not dist.is_initialized()
    assert not tp_workers()
    two = Engine(model=tp_model, tp_size=2, **OPTS)
    try:
        out = two.generate(input_ids=[3, 4, 5, 6], sampling_params={**G, "max_new_tokens": 4})
        assert len(out["output_ids"]) == 4
        assert_idle_clean(two)
    finally:
        two.shutdown()


def _turns(engines: list[Engine], sids: list[str]) -> None:
    """Session turns cut inside a run of accepted drafts (max_new_tokens lands mid-run): the lookahead
    pages of the drafts past the cut must not reach the session (seed 004). The first turn's verify
    step (12 + 1 tokens and 4 drafts) takes a second page that the cut (kv 14) leaves unused. Same
    output on all engines."""
    for turn, n in (([5, 6, 7] * 4, 3), ([9] * 5, 9), ([3], 7), ([4, 4], 2)):
        r = [e.generate(input_ids=turn, sampling_params={**G, "max_new_tokens": n}, session_params={"id": s})
             for e, s in zip(engines, sids)]  # fmt: skip
        assert all(o["output_ids"] == r[0]["output_ids"] for o in r), r
        assert r[-1]["meta_info"]["spec_verify_ct"] > 0
        s = engines[-1].core.sessions.sessions[sids[-1]]
        assert s.kv_len == len(s.tokens) - 1 and len(s.pages) == -(-s.kv_len // OPTS["page_size"]), s


# The new pairs run on one of the two models: what they add does not depend on how KV heads split.
@pytest.mark.parametrize("tp_model", ["kv_sharded"], indirect=True)
def test_tp_with_a_draft_model_equals_plain(tp_model):
    """TP x draft model: the draft runs on rank 0 (its K/V a buffer over rank 0's page ids), its drafts
    reach the workers inside the step and are verified by the sharded target. The target is its own
    draft, so nearly every draft is accepted (the draft K/V tracks the pages across retraction and
    session turns); seeded sampling rejects many (the truncate path). Output = the plain engine's."""
    plain = Engine(model=tp_model, **OPTS)
    spec = Engine(model=tp_model, tp_size=2, speculative_algorithm="standalone",
                  speculative_draft_model_path=tp_model, **OPTS)  # fmt: skip
    pids = spec.core.info.tp_worker_pids
    try:
        assert len(pids) == 1 and spec.core.scheduler.proposer.writes_kv
        assert _workload(spec) == _workload(plain)
        t = spec.core.scheduler.spec_totals
        assert t.verify_ct > 0 and t.accepted > 0.9 * t.drafted
        assert spec.core.scheduler.total_retractions > 0
        sps = [{"temperature": 0.8, "max_new_tokens": 16, "ignore_eos": True, "seed": s} for s in range(6)]
        prompt = [[7, 8, 9, 10] * 4]
        a, b = (e.generate(input_ids=prompt * 6, sampling_params=sps) for e in (plain, spec))
        assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
        assert t.drafted - t.accepted > 0  # some drafts were rejected and given back
        sids = [e.open_session() for e in (plain, spec)]
        _turns([plain, spec], sids)
        assert_idle_clean(spec)  # the session holds its KV, nothing more
        spec.close_session(sids[1])
        assert_idle_clean(spec)
    finally:
        spec.shutdown()
        plain.shutdown()
    assert not any(process_alive(p) for p in pids)


def _waves(eng: Engine, seed: int = 0) -> None:
    """Waves of 1-8 requests of 1-100 tokens stepped unevenly: decodes only, prefills only, chunks of
    several prompts, different sample-row counts (test_compile.py's bounded-compilation workload)."""
    rng = random.Random(seed)
    n = 0
    for _ in range(6):
        for _ in range(rng.choice([1, 2, 3, 5, 8])):
            prompt = [rng.randrange(5, 200) for _ in range(rng.choice([1, 3, 7, 20, 64, 100]))]
            eng.add_request(prompt, {"max_new_tokens": rng.choice([1, 2, 6, 20]), "ignore_eos": True}, rid=f"w{n}")
            n += 1
        for _ in range(rng.choice([1, 3, 8])):
            eng.step()
    eng.run_until_idle()


@pytest.mark.parametrize("tp_model", ["kv_sharded"], indirect=True)
def test_tp_with_torch_compile_equals_plain_and_never_recompiles(tp_model):
    """TP x torch.compile: every rank compiles its graph during rank 0's warm-up (which reaches the
    workers as ordinary steps); the collectives are opaque ops inside it, so each rank has one graph,
    and varied batches afterwards add no graph and no recompile on any rank. Output = the plain
    engine's (eager, one process)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    plain = Engine(model=tp_model, **OPTS)
    comp = Engine(model=tp_model, tp_size=2, enable_torch_compile=True, **OPTS)
    pids = comp.core.info.tp_worker_pids
    try:
        warm = comp.core.view.rank_stats()
        assert [r["rank"] for r in warm] == [0, 1]
        assert all(r["compiled_forwards"] > 0 for r in warm), warm  # every rank ran its graph
        assert [r["graphs"] for r in warm] == [1, 1], warm  # the collectives inside the one graph
        assert _workload(comp) == _workload(plain)
        _waves(comp)
        after = comp.core.view.rank_stats()
        for w, a in zip(warm, after):
            assert (a["graphs"], a["frames"]) == (w["graphs"], w["frames"]), (warm, after)
            assert a["compiled_forwards"] > w["compiled_forwards"] + 10, (warm, after)
        assert comp.core.scheduler.total_retractions > 0
        assert_idle_clean(comp)
    finally:
        comp.shutdown()
        plain.shutdown()
    assert not any(process_alive(p) for p in pids)


def _listening(pids: list[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes listen on."""
    import psutil

    return {(pid, c.laddr.ip, c.laddr.port) for pid in pids
            for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}  # fmt: skip


@pytest.mark.parametrize("tp_model", ["kv_sharded"], indirect=True)
def test_a_serving_tp_engine_listens_on_loopback_only(tp_model):
    """Issue 50 item 8: one machine's group is reachable from this machine only. Every socket rank 0 and
    its worker listen on while serving is on 127.0.0.1 (before: torch's TCPStore on every interface,
    for the engine's life), and the rendezvous port itself is closed once the group formed."""
    import os

    before = _listening([os.getpid()])
    two = Engine(model=tp_model, tp_size=2, **OPTS)
    try:
        pids = [os.getpid(), *two.core.info.tp_worker_pids]
        out = two.generate(input_ids=[3, 4, 5, 6], sampling_params={**G, "max_new_tokens": 4})
        assert len(out["output_ids"]) == 4
        opened = _listening(pids) - before
        assert opened and {ip for _, ip, _ in opened} == {"127.0.0.1"}, opened
        assert [r["rank"] for r in two.core.view.rank_stats()] == [0, 1]  # a typed gather from the worker
        assert_idle_clean(two)
    finally:
        two.shutdown()


@pytest.mark.parametrize("tp_model", ["kv_sharded"], indirect=True)
def test_a_worker_without_the_key_is_refused_and_the_group_still_forms(tp_model, tmp_path):
    """Issue 50 item 8: a worker rank started with another key, waiting at the rendezvous before the
    engine starts (so it reaches the store first), is refused before the group forms and exits; the
    engine's own worker joins and the engine serves. Before, any process reaching the port joined."""
    import json
    import os
    import subprocess
    import sys
    import time

    from kvledger.config import EngineConfig
    from tests.server_harness import free_port

    addr = f"127.0.0.1:{free_port()}"
    opts = {**OPTS, "tp_size": 2, "dist_init_addr": addr, "dist_timeout_s": 60.0}
    log_path = tmp_path / "rogue.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVLEDGER_TP_KEY": os.urandom(32).hex(),
           "KVLEDGER_TP_CONFIG": json.dumps(EngineConfig.from_flat(model=tp_model, **opts).flat())}  # fmt: skip
    with open(log_path, "w") as log:
        rogue = subprocess.Popen([sys.executable, "-m", "kvledger.parallel.worker", "1", addr, "INFO"],
                                 env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "joining the group" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        two = Engine(model=tp_model, **opts)
        try:
            out = two.generate(input_ids=[3, 4, 5, 6], sampling_params={**G, "max_new_tokens": 4})
            assert len(out["output_ids"]) == 4
            assert rogue.wait(timeout=60) != 0
            assert "does not hold this rank's key" in log_path.read_text(), log_path.read_text()[-2000:]
            assert_idle_clean(two)
        finally:
            two.shutdown()
    finally:
        if rogue.poll() is None:
            rogue.kill()
            rogue.wait()
