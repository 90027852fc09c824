"""Embeddings and scores of prompts with images (a vision-language model served for pooling): the
final-norm hidden states of an image+text prompt pooled (last, mean) equal transformers' in float32,
with chunked prefill splitting the image (mean pooling sums across its chunks); label logprobs after
an image equal transformers' last-row logprobs; the same image's prefix-cache hit gives the same
embedding; books clean. Strict engines, audited clean at teardown."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvledger.common.pooling import PoolingParams
from tests.engine.test_vision import ONE, TWO, ids, vlm_engines
from tests.helpers import tiny_image


@pytest.fixture
def make_vlm(llava):
    yield from vlm_engines(llava[0])


@torch.no_grad()
def reference(llava, text: str, images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final-norm hidden states ``[T, hidden]`` and last-row log-probabilities."""
    _, proc, ref = llava
    inputs = proc(text=text, images=images, return_tensors="pt")
    out = ref(**inputs, output_hidden_states=False)
    hidden = ref.model(**inputs).last_hidden_state[0]
    return hidden, torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def pooled(hidden: torch.Tensor, how: str) -> np.ndarray:
    v = hidden[-1] if how == "last" else hidden.mean(0)
    return (v / v.norm()).numpy()


@pytest.mark.parametrize("chunk", [None, 16])
def test_embeddings_of_image_prompts_equal_transformers(llava, make_vlm, chunk):
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    h_one, _ = reference(llava, ONE, [a])
    h_two, _ = reference(llava, TWO, [a, b])
    eng = make_vlm(**({"chunked_prefill_size": chunk} if chunk else {}))
    for how in ("last", "mean"):
        one, two = eng.encode(input_ids=[ids(llava, ONE), ids(llava, TWO)], pooling=how, image_data=[a, [a, b]])
        np.testing.assert_allclose(one["embedding"], pooled(h_one, how), atol=2e-5)
        np.testing.assert_allclose(two["embedding"], pooled(h_two, how), atol=2e-5)
        assert one["meta_info"]["prompt_tokens"] == h_one.shape[0]  # the image's tokens counted
    other = eng.encode(input_ids=ids(llava, ONE), pooling="last", image_data=b)
    assert not np.allclose(other["embedding"], pooled(h_one, "last"), atol=1e-3)  # another picture, not a's KV


def test_label_logprobs_after_an_image_equal_transformers(llava, make_vlm):
    img = tiny_image(3)
    _, lp = reference(llava, ONE, [img])
    eng = make_vlm(chunked_prefill_size=16)
    labels = [5, 17, 101]
    rid = eng.add_request(ids(llava, ONE), None, pooling=PoolingParams(label_token_ids=labels), image_data=img)
    eng.run_until_idle()
    got = eng.result(rid)["label_logprobs"]
    np.testing.assert_allclose(got, lp[labels].numpy(), atol=2e-5)
