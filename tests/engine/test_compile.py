"""--enable-torch-compile: the compiled forward gives the eager forward's greedy output (fp32)."""

from __future__ import annotations

import pytest

from kvledger import Engine
from tests.helpers import assert_idle_clean


def test_compiled_forward_matches_eager(tiny_loaded):
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 9)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    kw = dict(dtype="float32", page_size=16, max_total_tokens=2048, strict_memory=True)
    eager = Engine(loaded_model=tiny_loaded, **kw)
    compiled = Engine(loaded_model=tiny_loaded, enable_torch_compile=True, **kw)
    assert compiled.core.model.compiled is not None
    want = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=params)]
    got = [o["output_ids"] for o in compiled.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
    assert compiled.core.model.compiled_forwards >= 12  # the batch's prefill and decodes ran compiled
    # a lone request takes the eager path of the same engine; same answer
    assert compiled.generate(input_ids=prompts[1], sampling_params=params)["output_ids"] == want[1]
    assert_idle_clean(compiled)


def test_compilations_stay_bounded_under_varied_batches(tiny_loaded):
    """Issue 12's collapse suspect: recompiles on new shapes. Waves of 1-13 requests of 1-130 tokens,
    stepped unevenly, give every batch composition the scheduler makes (decodes only, prefills only,
    chunks of several prompts, different sample-row counts); after the warm-up's compile, none adds a
    graph or recompiles (bf16 with int4 weights: the mode of the report)."""
    import random

    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eng = Engine(loaded_model=tiny_loaded, dtype="bfloat16", quantization="int4", enable_torch_compile=True,
                 page_size=16, max_total_tokens=8192, strict_memory=True)  # fmt: skip
    warm = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
    assert warm[0] == 1
    # torch's thread count is in the graphs' guards: the step's thread governor (which changes it on
    # a loaded machine, kernels/governor.py) stays out of compiled forwards, or each change recompiles
    gov = eng.core.runner.threads
    if gov is not None:
        gov.tick = lambda: pytest.fail("the thread governor ticked under torch.compile")
    rng = random.Random(0)
    n = 0
    for _ in range(12):
        for _ in range(rng.choice([1, 2, 3, 5, 8, 13])):
            prompt = [rng.randrange(5, 200) for _ in range(rng.choice([1, 3, 7, 20, 64, 130]))]
            eng.add_request(
                prompt, {"max_new_tokens": rng.choice([1, 2, 6, 20]), "ignore_eos": True}, rid=f"r{n}"
            )
            n += 1
        for _ in range(rng.choice([1, 3, 8])):
            eng.step()
    eng.run_until_idle()
    assert eng.core.model.compiled_forwards > 20
    assert (counters["stats"]["unique_graphs"], counters["frames"]["total"]) == warm, dict(
        counters["recompiles"]
    )
    assert_idle_clean(eng)
