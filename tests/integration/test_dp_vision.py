"""Images through the one URL of ``kvledger serve --dp-size 2`` (SGLang's router in front of two
replicas of a tiny random LLaVA): chat ``image_url`` parts and ``/generate`` ``image_data`` reach
either replica (round robin) and answer token-exact against transformers in float32, the image's
tokens counted; a bad image is the replica's 400 naming the part, passed through the router in the
API's shape; every replica's books are clean at the end, no image embedding held."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.helpers import tiny_image
from tests.integration.test_dp_launcher import served
from tests.integration.test_dp_sessions import _clean, running_dp
from tests.integration.test_vision_server import ask, data_url, reference

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")


@pytest.fixture(scope="module")
def dp_vlm(llava, tmp_path_factory):
    yield from running_dp(llava[0], str(tmp_path_factory.mktemp("dp_vlm") / "dp.log"))


@torch.no_grad()
def raw_reference(llava, text: str, images: list, n: int) -> list[int]:
    """transformers' greedy ids for a raw prompt (no chat template), ``<image>`` where each image goes."""
    _, proc, ref = llava
    inputs = proc(text=text, images=images, return_tensors="pt")
    out = ref.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_images_through_the_router_on_both_replicas(llava, dp_vlm):
    img = tiny_image(11)
    want, n = reference(llava, ["what is ", img, " here"])
    client = openai.OpenAI(base_url=dp_vlm.url + "/v1", api_key="none", max_retries=0)
    served_before = [served(u) for u in dp_vlm.replicas]
    for _ in range(2):  # round robin: one on each replica
        r = ask(client, ["what is ", data_url(img), " here"])
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == n
    ids = raw_reference(llava, "look <image> now", [img], 5)
    for _ in range(2):
        body = {"text": "look <image> now", "image_data": [data_url(img)],
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        g = httpx.post(dp_vlm.url + "/generate", json=body, timeout=120)
        assert g.status_code == 200, g.text
        assert g.json()["output_ids"] == ids
    gained = [served(u) - b for u, b in zip(dp_vlm.replicas, served_before, strict=True)]
    assert min(gained) >= 2, gained  # both replicas encoded images
    for u in dp_vlm.replicas:
        info = _clean(u)
        assert info["memory"].get("image_embed_tokens", 0) == 0


def test_a_bad_image_through_the_router_is_the_replicas_400(dp_vlm):
    body = {"model": "default", "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}  # fmt: skip
    r = httpx.post(dp_vlm.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and "image" in err["message"], err
    g = httpx.post(dp_vlm.url + "/generate", json={"text": "a <image>", "image_data": ["data:image/png;base64,!!"]}, timeout=60)
    assert g.status_code == 400 and g.json()["error"]["param"] == "image_data[0]", g.text
    for u in dp_vlm.replicas:
        _clean(u)

