"""Qwen2-VL through the real server (``python -m kvledger serve``) and the ``openai`` client: chat
``image_url`` parts become ``<|vision_start|><|image_pad|><|vision_end|>`` in the template's text,
token-exact against transformers, streamed and not, one image and two of different sizes (dynamic
resolution: usage counts each image's own tokens); the same image again reports cached tokens and
the same answer (M-RoPE positions after a prefix hit), another image none; books clean after each."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_vision_qwen import IMG, ref_inputs
from tests.helpers import tiny_image
from tests.integration.conftest import started_server
from tests.integration.test_vision_server import ask, check_chat_with_images, clean_client, data_url

pytestmark = pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)


@pytest.fixture(scope="module")
def qwen_server(qwen_vl, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "qwen_vl.log")
    yield from started_server(qwen_vl[0], log, "--page-size", "4", "--max-images-per-prompt", "2")


@pytest.fixture
def client(qwen_server):
    yield from clean_client(qwen_server)


@torch.no_grad()
def reference(qwen_vl, parts: list, n: int = 6) -> tuple[str, int]:
    """transformers' greedy answer (``n`` tokens) to one user message of text pieces and images, the
    images written as Qwen's chat template writes them; and its prompt's length."""
    tok, ref = qwen_vl[2], qwen_vl[3]
    content = "".join(IMG if not isinstance(x, str) else x for x in parts)
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    inputs = ref_inputs(qwen_vl, text, [x for x in parts if not isinstance(x, str)])
    out = ref.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    n_prompt = inputs["input_ids"].shape[1]
    return tok.decode(out[0, n_prompt:], skip_special_tokens=True), n_prompt


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_images_is_token_exact(qwen_vl, client, stream):
    n1, n2 = check_chat_with_images(client, lambda parts: reference(qwen_vl, parts), stream)
    assert n2 - n1 > 30  # the second image's own 32 tokens (the first's 30)


def test_same_image_reports_cached_tokens_and_another_none(qwen_vl, client):
    img = tiny_image(3)
    want, _ = reference(qwen_vl, ["describe ", img, " briefly"])
    first = ask(client, ["describe ", data_url(img), " briefly"])
    again = ask(client, ["describe ", data_url(img), " briefly"])
    assert first.choices[0].message.content == again.choices[0].message.content == want
    assert again.usage.prompt_tokens_details.cached_tokens > 30  # past the image's tokens
    other = ask(client, ["describe ", data_url(tiny_image(4)), " briefly"])
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) < 20  # the template's head at most
