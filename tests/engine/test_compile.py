"""--enable-torch-compile: the compiled forward gives the eager forward's greedy output (fp32)."""

from __future__ import annotations

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
