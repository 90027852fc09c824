"""Images through the real server (``python -m kvledger serve``) and the ``openai`` client, on a
tiny random LLaVA: chat ``image_url`` parts (data: URLs, allowed local files) token-exact against
transformers, streamed and not, one and two images; usage counts image tokens; the same image again
reports cached tokens, another none; the Responses API's ``input_image``; bad images, refused URL
kinds and too many images a 400 naming the part, the server serving on; books clean after each."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from tests.helpers import tiny_image
from tests.integration.conftest import started_server


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    tiny_image(7).save(d / "seven.png")
    return d


@pytest.fixture(scope="module")
def vlm_server(llava, media_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "vlm.log")
    yield from started_server(
        llava[0], log, "--page-size", "4", "--allowed-local-media-path", str(media_dir), "--max-images-per-prompt", "2"
    )


def clean_client(server):
    """A fixture's body: an ``openai`` client of ``server``; afterwards the server idle and clean, no
    engine restart, no image embedding held."""
    restarts = server.info()["engine_restarts"]
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    info = server.wait_idle_clean()
    assert info["engine_restarts"] == restarts
    assert info["memory"].get("image_embed_tokens", 0) == 0


@pytest.fixture
def client(vlm_server):
    yield from clean_client(vlm_server)


@torch.no_grad()
def reference(llava, texts_and_images: list, n: int = 6, eos: bool = False) -> tuple[str, int]:
    """transformers' greedy answer to one user message (text pieces and images, in order): ``n``
    tokens, or with ``eos`` up to n that stop at the end-of-sequence token."""
    _, proc, ref = llava
    content = "".join("<image>" if not isinstance(x, str) else x for x in texts_and_images)
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=False)  # fmt: skip
    images = [x for x in texts_and_images if not isinstance(x, str)]
    inputs = proc(text=text, images=images, return_tensors="pt")
    stop = dict(eos_token_id=proc.tokenizer.eos_token_id) if eos else dict(min_new_tokens=n, eos_token_id=None)
    out = ref.generate(**inputs, max_new_tokens=n, do_sample=False, pad_token_id=0, **stop)
    new = out[0, inputs["input_ids"].shape[1] :]
    return proc.tokenizer.decode(new, skip_special_tokens=True), inputs["input_ids"].shape[1]


def message(parts: list) -> list[dict]:
    """One user message: URLs (data:, file:, http:) as image_url parts, other strings as text."""
    content = [
        {"type": "image_url", "image_url": {"url": x}}
        if x.startswith(("data:", "file:", "http:", "https:"))
        else {"type": "text", "text": x}
        for x in parts
    ]
    return [{"role": "user", "content": content}]


def ask(client, parts, stream: bool = False, **kw):
    args = dict(model="default", messages=message(parts), max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True}, **kw)  # fmt: skip
    if not stream:
        return client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


def check_chat_with_images(client, reference_of, stream: bool) -> tuple[int, int]:
    """One image, then two of different sizes, through the ``openai`` client (streamed or not): each
    answer ``reference_of(parts)``'s text and its usage the reference's prompt length (the images'
    tokens counted). Returns the two prompts' lengths."""
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    lengths = []
    for parts in (["what is ", a, " here"], ["compare ", a, " and ", b]):
        want, n = reference_of(parts)
        sent = [data_url(x) if not isinstance(x, str) else x for x in parts]
        if stream:
            text, usage = ask(client, sent, stream=True)
        else:
            r = ask(client, sent)
            text, usage = r.choices[0].message.content, r.usage
        assert text == want
        assert usage.prompt_tokens == n  # the image tokens counted
        lengths.append(n)
    return lengths[0], lengths[1]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_images_is_token_exact(llava, client, stream):
    check_chat_with_images(client, lambda parts: reference(llava, parts), stream)


def test_same_image_reports_cached_tokens_and_another_none(llava, client, media_dir):
    img = tiny_image(3)
    first = ask(client, ["describe ", data_url(img)])
    again = ask(client, ["describe ", data_url(img)])
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 36  # past the image's tokens
    other = ask(client, ["describe ", data_url(tiny_image(4))])
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) < 20  # the template's head at most
    # An allowed local file is the same picture as its data: URL.
    want, _ = reference(llava, ["see ", tiny_image(7)])
    r = ask(client, ["see ", f"file://{media_dir / 'seven.png'}"])
    assert r.choices[0].message.content == want


def test_responses_input_image(llava, vlm_server, client):
    img = tiny_image(5)
    want, n = reference(llava, ["what ", img], eos=True)
    import httpx

    body = {
        "model": "default", "max_output_tokens": 6, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "what "},
                                               {"type": "input_image", "image_url": data_url(img)}]}],
    }  # fmt: skip
    r = httpx.post(vlm_server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output"][-1]["content"][0]["text"] == want
    assert out["usage"]["input_tokens"] == n


def test_bad_images_are_400s_naming_the_part(client, vlm_server, media_dir):
    from PIL import Image

    bomb = io.BytesIO()
    Image.new("1", (6000, 6000)).save(bomb, format="PNG")
    good = data_url(tiny_image(1))
    cases = {
        "corrupt": "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode(),
        "truncated": good[: len(good) // 2],
        "bomb": "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode(),
        "unsupported": data_url(tiny_image(1), "TIFF"),
        "remote off": "https://example.com/cat.png",
        "private remote": "http://127.0.0.1:9/cat.png",
        "outside the allowed dir": "file:///etc/hostname",
        "traversal": f"file://{media_dir}/../../etc/passwd",
    }
    for name, url in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, ["look ", data_url(tiny_image(1)), url])
        assert e.value.body["param"] == "messages[0].content[2]", (name, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:  # --max-images-per-prompt 2
        ask(client, [good, good, good])
    assert e.value.body["param"] == "messages[0].content[2]"
    r = ask(client, ["still ", good])  # the server serves on
    assert r.choices[0].finish_reason == "length"


def test_text_only_server_refuses_image_parts(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=message(["hi ", data_url(tiny_image(1))]), max_tokens=2)
    assert "takes no images" in e.value.body["message"]
    assert e.value.body["param"] == "messages[0].content[1]"


def test_generate_image_data(llava, vlm_server, client):
    """SGLang's /generate: ``image_data`` (a data: URL, or bare base64) for the text's placeholders."""
    import httpx

    a, b = tiny_image(8), tiny_image(9)
    _, proc, _ = llava
    text = "<|user|>one <image> two <image></s><|assistant|>"
    inputs = proc(text=text, images=[a, b], return_tensors="pt")
    with torch.no_grad():
        out = llava[2].generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                                eos_token_id=None)  # fmt: skip
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    bare = data_url(b).split(",", 1)[1]
    body = {"text": text, "image_data": [data_url(a), bare],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    r = httpx.post(vlm_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want
    assert r.json()["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    body["image_data"] = [data_url(a)]  # two placeholders, one image
    r = httpx.post(vlm_server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and "placeholders" in r.json()["error"]["message"]


def test_a_session_with_images_over_generate_and_an_engine_restart(llava, vlm_server):
    """SGLang's sessions with images: a turn's image and a later text-only turn answer as transformers
    does on the whole conversation; the books hold the session's images until it closes. After an
    engine restart a session with images is not re-opened (its images were the old engine's): its next
    turn is the 404 of a session that is gone, while a text-only session goes on."""
    import os
    import signal
    import time

    import httpx

    _, proc, ref = llava
    img = tiny_image(12)
    t1, t2 = "<|user|>see <image> here</s><|assistant|>", "<|user|>more?</s><|assistant|>"
    p1 = proc(text=t1, images=[img], return_tensors="pt")
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}

    @torch.no_grad()
    def want(prompt: list[int]) -> list[int]:
        x = torch.tensor([prompt])
        out = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=p1["pixel_values"],
                           max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    def turn(sid: str, text: str, **kw) -> httpx.Response:
        body = {"text": text, "sampling_params": sp, "session_params": {"id": sid}, **kw}
        return httpx.post(vlm_server.url + "/generate", json=body, timeout=60)

    sid = httpx.post(vlm_server.url + "/open_session", json={}, timeout=30).json()
    r1 = turn(sid, t1, image_data=[data_url(img)])
    assert r1.status_code == 200, r1.text
    prompt = p1["input_ids"][0].tolist()
    assert r1.json()["output_ids"] == want(prompt)
    prompt += r1.json()["output_ids"] + proc.tokenizer(t2)["input_ids"]
    r2 = turn(sid, t2)
    assert r2.json()["output_ids"] == want(prompt)
    assert vlm_server.info()["memory"]["session_image_bytes"] > 0
    plain = httpx.post(vlm_server.url + "/open_session", json={}, timeout=30).json()
    assert turn(plain, t2).status_code == 200
    restarts = vlm_server.info()["engine_restarts"]
    os.kill(vlm_server.info()["engine_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if vlm_server.info()["engine_restarts"] > restarts and httpx.get(vlm_server.url + "/health").status_code == 200:
                break
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.3)
    gone = turn(sid, t2)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found", gone.text
    assert turn(plain, t2).status_code == 200  # a text-only session was re-opened and goes on
    assert httpx.post(vlm_server.url + "/close_session", json={"session_id": plain}, timeout=30).status_code == 200
    info = vlm_server.wait_idle_clean()
    assert info["memory"].get("session_image_bytes", 0) == 0


@torch.no_grad()
def test_embeddings_of_chat_messages_with_images(llava, vlm_server, client):
    """vLLM's chat form of ``/v1/embeddings``: the messages (an image part included) through the chat
    template, the last row's final hidden state (``--pooling last``) equal to transformers'; a bad
    image part a 400 naming it; ``input`` and ``messages`` together a 400."""
    import httpx
    import numpy as np

    _, proc, ref = llava
    img = tiny_image(5)
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "what is <image> here"}],
                                              add_generation_prompt=False, tokenize=False)  # fmt: skip
    inputs = proc(text=text, images=[img], return_tensors="pt")
    want = ref.model(**inputs).last_hidden_state[0, -1]
    want = (want / want.norm()).numpy()
    body = {"model": "default", "messages": message(["what is ", data_url(img), " here"])}
    r = httpx.post(vlm_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    np.testing.assert_allclose(out["data"][0]["embedding"], want, atol=2e-5)
    assert out["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]  # the image's tokens counted
    bad = {"model": "default", "messages": message(["what is ", "data:image/png;base64,AAAA"])}
    r = httpx.post(vlm_server.url + "/v1/embeddings", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"
    r = httpx.post(vlm_server.url + "/v1/embeddings", json={**body, "input": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
