"""``--interleave-prefill-tokens``: while requests decode, a prefill step brings at most that many
prompt tokens and a decode step follows it; 0 keeps prefill first. ``--mixed-step-ratio``: that budget
paced by the measured step costs (``scheduler/pacing.py``). Outputs never depend on either (fp32)."""

from __future__ import annotations

import pytest
import torch

from kvledger import Engine, ValidationError
from kvledger.config import (
    CPU_INTERLEAVE_PREFILL_TOKENS,
    CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX,
    SchedulerSettings,
)
from kvledger.config.base import CPU_MIXED_STEP_RATIO
from kvledger.model.linear import amx_available
from tests.helpers import FixedCosts

G = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = [[3 + i] * 10 + list(range(20 + i, 40 + i)) for i in range(6)]  # 30 tokens each


def _record_steps(eng) -> list[tuple[int, int]]:
    """(decode rows, prompt tokens) of every forward ``eng`` runs from now on."""
    steps: list[tuple[int, int]] = []
    ex = eng.core.executor
    run = ex.execute_model

    def recorded(sched):
        reqs = eng.core.scheduler.reqs
        dec = sum(1 for r in sched.reqs if r.start >= len(reqs[r.rid].input_ids))
        steps.append((dec, sched.num_tokens - dec))
        return run(sched)

    ex.execute_model = recorded
    return steps


def _burst(eng) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """One request decoding, then a burst of five arrives: their outputs and the steps run."""
    first = eng.add_request(PROMPTS[0], {**G, "max_new_tokens": 30})
    for _ in range(3):
        eng.step()
    steps = _record_steps(eng)
    rids = [first] + [eng.add_request(p, {**G, "max_new_tokens": 12}) for p in PROMPTS[1:]]
    eng.run_until_idle()
    return [eng.result(r)["output_ids"] for r in rids], steps


@pytest.mark.parametrize("mixed", [False, True])
def test_prefill_steps_alternate_with_decodes_and_outputs_do_not_change(make_engine, mixed):
    # (No pacing: the fixed budget alone; pacing's own tests below.)
    kw = dict(chunked_prefill_size=256, enable_mixed_chunk=mixed, mixed_step_ratio=0)
    first_out, first_steps = _burst(make_engine(interleave_prefill_tokens=0, **kw))
    out, steps = _burst(make_engine(interleave_prefill_tokens=64, **kw))
    assert out == first_out
    # Prefill first: the whole burst (150 tokens) in one step before the running request decodes.
    assert first_steps[0][1] == 150
    # Interleaved: never more than 64 prompt tokens in a step (the first request decodes throughout;
    # mixed, the step's decodes count against the budget, as its chunked_prefill_size does).
    assert max(pf + dec * mixed for dec, pf in steps) == 64, steps
    assert sum(pf for _, pf in steps) == 150
    if not mixed:
        # A decode step between every two prefill steps; the burst's first prompts start decoding
        # while the later ones are still waiting.
        kinds = "".join("p" if pf else "d" for _, pf in steps)
        assert "pp" not in kinds and kinds.count("p") == 3, kinds
        pf_steps = [i for i, k in enumerate(kinds) if k == "p"]
        assert max(dec for dec, _ in steps[: pf_steps[-1]]) >= 2


def test_without_decodes_the_chunk_budget_holds(make_engine):
    """Nothing decodes: a long prompt runs in chunked_prefill_size chunks, back to back."""
    eng = make_engine(interleave_prefill_tokens=16, chunked_prefill_size=64)
    steps = _record_steps(eng)
    eng.generate(input_ids=list(range(3, 123)), sampling_params={**G, "max_new_tokens": 2})
    assert [pf for _, pf in steps[:2]] == [64, 56]


def test_default_and_validation(tiny_loaded, monkeypatch):
    s = SchedulerSettings()
    for amx, want in ((True, CPU_INTERLEAVE_PREFILL_TOKENS), (False, CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert s.interleave_tokens("cpu", amx_available()) == want
    monkeypatch.undo()
    assert s.interleave_tokens("cuda:0", True) == s.interleave_tokens("cuda:0", False) == 0
    assert SchedulerSettings(interleave_prefill_tokens=0).interleave_tokens("cpu", True) == 0
    with pytest.raises(ValidationError, match="interleave_prefill_tokens must be >= 0"):
        Engine(loaded_model=tiny_loaded, interleave_prefill_tokens=-1)


@pytest.mark.parametrize("mixed", [False, True])
def test_paced_steps_keep_the_decodes_within_the_ratio_and_outputs_do_not_change(make_engine, mixed):
    """Pacing: a decode step costs 10 ms whatever its rows, a prompt token 1 ms (prompt steps 2 ms
    more, mixed forwards 10 ms more). Ratio 3: unmixed, a prompt step may cost 30 - 10 = 20 ms, 18
    tokens, and a decode step follows each; mixed, a forward 30 ms, 20 rows, decodes included."""
    kw = dict(chunked_prefill_size=256, enable_mixed_chunk=mixed, interleave_prefill_tokens=64)
    first_out, _ = _burst(make_engine(interleave_prefill_tokens=0, chunked_prefill_size=256, enable_mixed_chunk=mixed))
    eng = make_engine(mixed_step_ratio=3, **kw)
    eng.core.scheduler.policy.costs = FixedCosts((0.010, 0.0), (0.002, 0.001), (0.010, 0.001))
    out, steps = _burst(eng)
    assert out == first_out
    assert sum(pf for _, pf in steps) == 150
    paced = [(dec, pf) for dec, pf in steps if dec and pf]  # prompt tokens while requests decode
    if mixed:
        assert paced and max(dec + pf for dec, pf in paced) == 20, steps
    else:
        assert not paced
        kinds = "".join("p" if pf else "d" for _, pf in steps)
        assert "pp" not in kinds, kinds
        assert max(pf for _, pf in steps) == 18 and kinds.count("p") >= 150 // 18, steps


def test_pacing_default_and_validation(tiny_loaded):
    s = SchedulerSettings()
    assert s.step_ratio("cpu") == CPU_MIXED_STEP_RATIO and s.step_ratio("cuda:0") == 0
    assert SchedulerSettings(mixed_step_ratio=0).step_ratio("cpu") == 0
    assert SchedulerSettings(mixed_step_ratio=4).step_ratio("cuda") == 4
    for bad in (1, 0.5, -2, float("inf")):
        with pytest.raises(ValidationError, match="mixed_step_ratio must be 0"):
            Engine(loaded_model=tiny_loaded, mixed_step_ratio=bad)
