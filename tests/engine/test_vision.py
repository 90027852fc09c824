"""Images in (``multimodal/``), at the engine: a tiny random LLaVA (CLIP tower, projector, Llama
decoder) token-exact against transformers in float32, with one and two images, chunked prefill
splitting an image, batched beside text requests; the prefix cache keyed by image content; the
image embeddings' books (held between chunks, released on finish, abort and retraction); bad images
a 400 before anything is held. Strict engines, audited clean at teardown."""

from __future__ import annotations

import io
import os

import pytest
import torch

from kvledger.errors import ValidationError
from tests.helpers import assert_idle_clean, tiny_image

G = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ONE = "<|user|>look <image> and say</s><|assistant|>"
TWO = "<|user|>first <image> then <image> compare</s><|assistant|>"


def vlm_engines(path: str):
    """A fixture's body: ``make(**kw)`` builds strict fp32 engines of the vision model at ``path``,
    each audited clean (images included) at teardown."""
    from kvledger import Engine

    engines = []

    def make(**kw):
        opts = dict(dtype="float32", page_size=4, max_total_tokens=4096, strict_memory=True)
        opts.update(kw)
        eng = Engine(model=path, **opts)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        assert_images_clean(eng)


@pytest.fixture
def make_vlm(llava):
    yield from vlm_engines(llava[0])


def assert_images_clean(eng) -> None:
    assert_idle_clean(eng)
    assert not eng.core.scheduler.images.held
    assert not eng.core.runner.images.held  # every image's embeddings dropped
    assert eng.memory().get("image_embed_tokens", 0) == 0


@torch.no_grad()
def reference(llava, text: str, images: list, n: int = 8) -> tuple[list[int], list[int]]:
    """transformers' prompt (placeholders expanded by its processor) and greedy continuation."""
    _, proc, ref = llava
    inputs = proc(text=text, images=images, return_tensors="pt")
    out = ref.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


def ids(llava, text: str) -> list[int]:
    return llava[1].tokenizer(text)["input_ids"]


@pytest.mark.parametrize("chunk", [None, 16, 5])
def test_one_image_token_exact(llava, make_vlm, chunk):
    img = tiny_image(1)
    prompt, want = reference(llava, ONE, [img])
    eng = make_vlm(**({"chunked_prefill_size": chunk} if chunk else {}))
    out = eng.generate(input_ids=ids(llava, ONE), sampling_params=G, image_data=img)
    assert out["output_ids"] == want
    assert out["meta_info"]["prompt_tokens"] == len(prompt)  # the image's 36 tokens counted
    # The served name is the directory's (it once came out as the checkpoint's last tensor name).
    assert eng.core.view.info_dict()["model_name"] == os.path.basename(os.path.normpath(llava[0]))


def test_two_images_token_exact_and_batched_beside_text(llava, make_vlm):
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    _, want_two = reference(llava, TWO, [a, b])
    _, want_one = reference(llava, ONE, [b])
    eng = make_vlm(chunked_prefill_size=32)
    text = list(range(3, 60))
    want_text = make_vlm().generate(input_ids=text, sampling_params=G)["output_ids"]
    outs = eng.generate(
        input_ids=[ids(llava, TWO), text, ids(llava, ONE)], sampling_params=G, image_data=[[a, b], None, b]
    )
    assert [o["output_ids"] for o in outs] == [want_two, want_text, want_one]
    assert eng.core.runner.images.encoded == 2  # b once: the encoder cache (or the step's batch) has it


def test_same_image_reuses_its_kv_and_another_image_never_does(llava, make_vlm):
    a, b = tiny_image(1), tiny_image(2)
    _, want_a = reference(llava, ONE, [a])
    _, want_b = reference(llava, ONE, [b])
    eng = make_vlm()
    p = ids(llava, ONE)
    first = eng.generate(input_ids=p, sampling_params=G, image_data=a)
    assert first["meta_info"]["cached_tokens"] == 0
    again = eng.generate(input_ids=p, sampling_params=G, image_data=a)
    assert again["output_ids"] == want_a
    n = again["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] == (n - 1) // 4 * 4  # all but the last token, page-aligned
    other = eng.generate(input_ids=p, sampling_params=G, image_data=b)
    assert other["output_ids"] == want_b  # not a's KV: the image's pages are keyed by its content
    assert other["meta_info"]["cached_tokens"] < p.index(llava[1].tokenizer.convert_tokens_to_ids("<image>")) + 4
    # The same picture in another encoding decodes to the same pixels: the same key.
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    png = eng.generate(input_ids=p, sampling_params=G, image_data=buf.getvalue())
    assert png["meta_info"]["cached_tokens"] == again["meta_info"]["cached_tokens"]
    salted = eng.generate(input_ids=p, sampling_params={**G, "cache_salt": "t1"}, image_data=a)
    assert salted["meta_info"]["cached_tokens"] == 0 and salted["output_ids"] == want_a


def test_embeddings_held_between_chunks_are_released_on_abort_and_retraction(llava, make_vlm):
    eng = make_vlm(chunked_prefill_size=8)
    img = tiny_image(4)
    rid = eng.add_request(ids(llava, ONE), G, image_data=img)
    for _ in range(2):
        eng.step()  # the image's first tokens prefilled: its embeddings wait for the rest
    assert len(eng.core.runner.images.held) == 1
    assert eng.memory()["image_embed_tokens"] == 36
    eng.abort(rid)
    eng.run_until_idle()
    assert_images_clean(eng)
    # Retraction: the embeddings go, the request is encoded again when readmitted; same answer.
    _, want = reference(llava, ONE, [img])
    rid = eng.add_request(ids(llava, ONE), G, image_data=img)
    for _ in range(2):
        eng.step()
    req = eng.core.scheduler.reqs[rid]
    eng.core.scheduler.policy.retract(req)
    assert not eng.core.scheduler.images.held
    eng.run_until_idle()
    assert eng.result(rid)["output_ids"] == want


def test_bad_images_are_400s_naming_the_part_before_anything_is_held(llava, make_vlm, tmp_path):
    from PIL import Image

    eng = make_vlm()
    before = eng.memory()
    good = io.BytesIO()
    tiny_image(1).save(good, format="PNG")
    bomb = io.BytesIO()
    Image.new("1", (6000, 6000)).save(bomb, format="PNG")  # 36 Mpx in a few KB
    tiff = io.BytesIO()
    tiny_image(1).save(tiff, format="TIFF")
    cases = {
        "corrupt": b"\x89PNG\r\n\x1a\n" + b"garbage" * 20,
        "truncated": good.getvalue()[: len(good.getvalue()) // 2],
        "bomb": bomb.getvalue(),
        "unsupported": tiff.getvalue(),
        "not base64": "data:image/png;base64,@@@@",
        "remote": "http://127.0.0.1:1/x.png",
    }
    p = ids(llava, TWO)
    for name, bad in cases.items():
        with pytest.raises(ValidationError) as e:
            eng.generate(input_ids=p, sampling_params=G, image_data=[tiny_image(1), bad])
        assert e.value.param == "image_data[1]", name
    with pytest.raises(ValidationError, match="2 image placeholders for 1 images"):
        eng.generate(input_ids=p, sampling_params=G, image_data=[tiny_image(1)])
    assert eng.memory()["kv_free"] == before["kv_free"] and not eng.core.scheduler.reqs


def test_a_text_only_model_refuses_images(make_engine):
    eng = make_engine(page_size=4)
    with pytest.raises(ValidationError, match="takes no images") as e:
        eng.generate(input_ids=[3, 4, 5], sampling_params=G, image_data=tiny_image(1))
    assert e.value.param == "image_data"


TURN2 = "<|user|>now <image> again</s><|assistant|>"
TURN3 = "<|user|>and so?</s><|assistant|>"


@torch.no_grad()
def reference_ids(llava, prompt: list[int], images: list, n: int = 8) -> list[int]:
    """transformers' greedy continuation of an expanded prompt (ids) whose image runs are ``images``."""
    _, proc, ref = llava
    pixels = torch.cat([proc.image_processor(im, return_tensors="pt")["pixel_values"] for im in images])
    x = torch.tensor([prompt])
    out = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pixels, max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("chunk", [None, 16])
def test_images_in_a_session_across_turns_and_a_recomputed_history(llava, make_vlm, chunk):
    """A session's turns with images equal transformers on the whole conversation; the history's images
    are the session's, so a turn after its KV was dropped (recomputed from the tokens) encodes them
    again and answers the same; a rewind into an image's tokens is a 400; closing gives them back."""
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    eng = make_vlm(**({"chunked_prefill_size": chunk} if chunk else {}))
    sid = eng.open_session()
    p1, want1 = reference(llava, ONE, [a])
    t1 = eng.generate(input_ids=ids(llava, ONE), sampling_params=G, image_data=a, session_params={"id": sid})
    assert t1["output_ids"] == want1
    p2 = llava[1](text=TURN2, images=[b], return_tensors="pt")["input_ids"][0].tolist()
    history = p1 + want1 + p2
    want2 = reference_ids(llava, history, [a, b])
    t2 = eng.generate(input_ids=ids(llava, TURN2), sampling_params=G, image_data=b, session_params={"id": sid})
    assert t2["output_ids"] == want2
    assert t2["meta_info"]["cached_tokens"] >= len(p1)  # the first turn's KV, image included, read back
    assert eng.memory()["session_image_bytes"] > 0
    # The session's KV dropped (as for room): the next turn recomputes the history, both images in it.
    assert eng.core.kv_manager.sessions.drop_all_kv() > 0
    history += want2 + ids(llava, TURN3)
    want3 = reference_ids(llava, history, [a, b])
    t3 = eng.generate(input_ids=ids(llava, TURN3), sampling_params=G, session_params={"id": sid})
    assert t3["output_ids"] == want3
    assert t3["meta_info"]["cached_tokens"] < len(p1)  # recomputed, not read
    # A rewind to before the second turn keeps the first image only; into an image, refused.
    start = p1.index(llava[1].tokenizer.convert_tokens_to_ids("<image>"))
    with pytest.raises(ValidationError, match="inside an image") as e:
        eng.generate(input_ids=[5], sampling_params=G, session_params={"id": sid, "offset": start + 3})
    assert e.value.param == "session_params.offset"
    back = len(p1) + len(want1)
    t4 = eng.generate(input_ids=ids(llava, TURN3), sampling_params=G, session_params={"id": sid, "offset": back})
    assert t4["output_ids"] == reference_ids(llava, p1 + want1 + ids(llava, TURN3), [a])
    assert eng.core.sessions.describe()[0]["images"] == 1
    eng.close_session(sid)
    assert eng.memory()["session_image_bytes"] == 0


@pytest.mark.parametrize("algorithm", ["STANDALONE", "NGRAM"])
def test_speculative_drafts_with_images_are_token_exact(llava, make_vlm, algorithm):
    """A draft model (here the LLaVA's own language model, loaded as a text model) reads an image's
    placeholder tokens without its embeddings: worse drafts, never other output, since the target
    verifies every one; NGRAM drafts likewise. Books clean (the drafts' pages are the request's)."""
    a, b = tiny_image(1), tiny_image(2)
    _, want_a = reference(llava, ONE, [a], n=12)
    _, want_b = reference(llava, ONE, [b], n=12)
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3}
    if algorithm == "STANDALONE":
        spec["speculative_draft_model_path"] = llava[0]
    eng = make_vlm(chunked_prefill_size=16, **spec)
    p = ids(llava, ONE)
    outs = eng.generate(input_ids=[p, p], sampling_params={**G, "max_new_tokens": 12}, image_data=[a, b])
    assert [o["output_ids"] for o in outs] == [want_a, want_b]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)  # drafts were made and verified


def test_images_through_pd_equal_one_engine_and_another_image_is_refused(llava, make_vlm):
    """PD with images: both sides get the request's images (the router sends the same body to both);
    prefill encodes them and computes the prompt's KV, decode takes it and answers as one engine does;
    decode's own prefix cache, keyed by the image's content, shortens the second transfer of the same
    image and not one of another. The claim's checksum covers the images' digests, so a decode request
    whose image differs from prefill's (the same placeholder tokens) is refused, never handed the other
    picture's KV. A session turn with images through PD is a 400. Both sides' books clean."""
    from kvledger.common.disagg import DisaggParams
    from tests.engine.test_disagg import drive, stats, until_idle
    from tests.server_harness import free_port

    port = free_port()
    pre = make_vlm(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                   disaggregation_bind_host="127.0.0.1", page_size=16)  # fmt: skip
    dec = make_vlm(disaggregation_mode="decode", disaggregation_bootstrap_port=port, page_size=4)
    a, b = tiny_image(1), tiny_image(2)
    p = ids(llava, ONE)
    sp = {**G, "max_new_tokens": 6}
    try:
        outs = []
        for k, img in enumerate((a, a, b)):
            room = DisaggParams("127.0.0.1", port, 10 + k)
            pre.add_request(p, sp, rid=f"p{k}", disagg=room, image_data=img)
            dec.add_request(p, sp, rid=f"d{k}", disagg=room, image_data=img)
            outs.append(drive([pre, dec], {id(pre): [f"p{k}"], id(dec): [f"d{k}"]})[f"d{k}"])
        assert outs[0]["output_ids"] == reference(llava, ONE, [a], n=6)[1]
        assert outs[1]["output_ids"] == outs[0]["output_ids"]
        assert outs[2]["output_ids"] == reference(llava, ONE, [b], n=6)[1]
        n = outs[0]["meta_info"]["prompt_tokens"]
        assert outs[1]["meta_info"]["cached_tokens"] == (n - 1) // 4 * 4  # decode's cache: the same image
        assert outs[2]["meta_info"]["cached_tokens"] < p.index(llava[1].tokenizer.convert_tokens_to_ids("<image>")) + 4
        assert stats(dec)["transfers_ok"] == 3
        # The same placeholder tokens with another picture on decode: refused as a different prompt.
        room = DisaggParams("127.0.0.1", port, 20)
        pre.add_request(p, sp, rid="px", disagg=room, image_data=a)
        dec.add_request(p, sp, rid="dx", disagg=room, image_data=tiny_image(3))
        res = drive([pre, dec], {id(pre): ["px"], id(dec): ["dx"]})
        fr = res["dx"]["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and "prompt differs" in fr["message"], fr
        sid = dec.open_session()
        with pytest.raises(ValidationError, match="not served through PD") as e:
            dec.add_request(p, sp, disagg=DisaggParams("127.0.0.1", port, 21), image_data=a, session_params={"id": sid})
        assert e.value.param == "session_params"
        dec.close_session(sid)
    finally:
        for eng in (pre, dec):
            eng.core.disagg_connector.timeout_s = 0.1
            until_idle(eng)
            eng.core.disagg_connector.close()
