"""Images with tensor parallel (``--tp-size 2``): rank 0 encodes every image a step feeds (it alone has
the vision tower, the held embeddings and the encoder cache, so its books describe all there is) and
the step's frame carries the rows every rank splices (``parallel/frames.ImageRows``). Token-exact
against transformers in float32 for the LLaVA family and for Qwen2-VL / Qwen2.5-VL (M-RoPE rows
crossing with the step), chunked prefill splitting an image, batched beside text; an abort and a
retraction mid-image prefill leave the books clean and the ranks in step (the next request is exact
again). Strict engines, audited clean (books, held embeddings) at teardown."""

from __future__ import annotations

import pytest
import torch

from tests.engine import test_vision as llava_tests
from tests.engine import test_vision_qwen as qwen_tests
from tests.engine.test_vision import assert_images_clean, vlm_engines
from tests.helpers import tiny_image

G = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
TP = dict(tp_size=2, chunked_prefill_size=16)  # an image's tokens (36 / 30) split over chunks


def tp_engines(path: str):
    """``vlm_engines``' strict fp32 engines, audited clean at teardown, then shut down (a TP engine's
    group must end before the next one forms in this process)."""
    made = []
    gen = vlm_engines(path)
    make = next(gen)
    try:
        yield lambda **kw: made.append(make(**kw)) or made[-1]
        next(gen, None)  # the audit
    finally:
        for eng in made:
            eng.shutdown()


@pytest.fixture
def make_llava(llava):
    yield from tp_engines(llava[0])


@pytest.fixture
def make_qwen(qwen_vl):
    yield from tp_engines(qwen_vl[0])


def _abort_and_retract_mid_image(eng, prompt: list[int], img, want: list[int]) -> None:
    """A request aborted once its first chunk fed part of the image (embeddings held on rank 0), then
    one retracted there: the books clean, the re-prefilled request exact (every rank in step)."""
    eng.flush_cache()  # no prefix-cache hit over the image: the first chunk feeds part of it
    rid = eng.add_request(prompt, G, image_data=img)
    eng.step()
    assert len(eng.core.runner.images.held) == 1 and eng.memory()["image_embed_tokens"] > 0
    eng.abort(rid)
    eng.run_until_idle()
    assert_images_clean(eng)
    eng.flush_cache()  # the next request prefills again (no prefix-cache hit over the image)
    rid = eng.add_request(prompt, G, image_data=img)
    eng.step()
    assert eng.core.runner.images.held
    eng.core.scheduler.policy.retract(eng.core.scheduler.reqs[rid])
    assert not eng.core.scheduler.images.held
    eng.run_until_idle()
    assert eng.result(rid)["output_ids"] == want
    assert_images_clean(eng)


def test_llava_tp2_token_exact_and_books_clean(llava, make_llava):
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    one, two = llava_tests.ids(llava, llava_tests.ONE), llava_tests.ids(llava, llava_tests.TWO)
    _, want_a = llava_tests.reference(llava, llava_tests.ONE, [a])
    _, want_two = llava_tests.reference(llava, llava_tests.TWO, [a, b])
    _, want_b = llava_tests.reference(llava, llava_tests.ONE, [b])
    text = list(range(3, 60))
    with torch.no_grad():
        ref = llava[2].generate(torch.tensor([text]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                pad_token_id=0, eos_token_id=None)  # fmt: skip
    eng = make_llava(**TP)
    assert eng.core.info.tp_size == 2
    assert eng.generate(input_ids=one, sampling_params=G, image_data=a)["output_ids"] == want_a
    outs = eng.generate(input_ids=[two, text, one], sampling_params=G, image_data=[[a, b], None, b])
    assert [o["output_ids"] for o in outs] == [want_two, ref[0, len(text) :].tolist(), want_b]
    again = eng.generate(input_ids=one, sampling_params=G, image_data=a)
    assert again["output_ids"] == want_a and again["meta_info"]["cached_tokens"] > 0  # its KV on every rank
    assert eng.core.runner.images.encoded == 2  # rank 0's encoder, a and b once (the encoder cache)
    assert_images_clean(eng)
    _abort_and_retract_mid_image(eng, one, b, want_b)


def test_qwen_vl_tp2_token_exact_with_mrope_rows(qwen_vl, make_qwen):
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    one, two = qwen_tests.ids(qwen_vl, qwen_tests.ONE), qwen_tests.ids(qwen_vl, qwen_tests.TWO)
    _, want_two = qwen_tests.reference(qwen_vl, qwen_tests.TWO, [a, b])
    _, want_b = qwen_tests.reference(qwen_vl, qwen_tests.ONE, [b])
    text = list(range(3, 60))
    with torch.no_grad():  # a text-only request: plain positions
        ref = qwen_vl[3].generate(torch.tensor([text]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)  # fmt: skip
    eng = make_qwen(**TP)
    outs = eng.generate(input_ids=[two, text, one], sampling_params=G, image_data=[[a, b], None, b])
    assert [o["output_ids"] for o in outs] == [want_two, ref[0, len(text) :].tolist(), want_b]
    assert_images_clean(eng)
    _abort_and_retract_mid_image(eng, one, b, want_b)
