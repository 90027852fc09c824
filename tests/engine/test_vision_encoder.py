"""The vision encoder across requests (``multimodal/embeds.py``, ``scheduler/images.py``): the images
of several requests in one step encoded in one vision-tower call, token-exact against transformers;
the encoder-output cache keyed by the image's content — a repeated image behind other text (no prefix
hit) skips the encoder, counted in tower calls — its entries owned by the cache, within the byte
budget (LRU), in ``memory()``, mirrored by the runner, dropped on ``flush_cache``; books clean."""

from __future__ import annotations

import pytest

from tests.engine.test_vision import ONE, G, assert_images_clean, ids, reference
from tests.helpers import tiny_image

ROW = 64 * 4  # the tiny LLaVA's embedding row: hidden 64, float32
IMAGE = 36 * ROW  # one image's embeddings, in bytes


@pytest.fixture
def make_vlm(llava):
    from kvledger import Engine

    engines = []

    def make(**kw):
        eng = Engine(model=llava[0], **{"dtype": "float32", "page_size": 4, "max_total_tokens": 4096,
                                        "strict_memory": True, **kw})  # fmt: skip
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        assert_images_clean(eng)
        books = eng.core.scheduler.images.cache
        runner = eng.core.runner.images
        assert set(runner.cache) == (set(books.entries) if books is not None else set())


def tower_calls(eng) -> int:
    return eng.core.runner.images.encoder.calls


def test_images_of_one_step_share_one_tower_call(llava, make_vlm):
    imgs = [tiny_image(11), tiny_image(12, (30, 60)), tiny_image(13, (70, 20))]  # resized alike by the processor
    want = [reference(llava, ONE, [im])[1] for im in imgs]
    eng = make_vlm(encoder_cache_bytes=0)
    outs = eng.generate(input_ids=[ids(llava, ONE)] * 3, sampling_params=G, image_data=imgs)
    assert [o["output_ids"] for o in outs] == want
    assert eng.core.runner.images.encoded == 3
    assert tower_calls(eng) == 1  # the three requests' first chunks ran in one step
    new = tiny_image(14)
    again = eng.generate(input_ids=[ids(llava, ONE)] * 2, sampling_params=G, image_data=[new, new])
    assert [o["output_ids"] for o in again] == [reference(llava, ONE, [new])[1]] * 2  # one step: encoded once
    assert eng.core.runner.images.encoded == 4
    assert "encoder_cache_bytes" not in eng.memory()  # the cache is off


def test_a_repeated_image_skips_the_encoder(llava, make_vlm):
    img = tiny_image(21)
    first_text = "<|user|>what is <image> here</s><|assistant|>"
    other_text = "<|user|>and now, in other words, tell me about <image> please</s><|assistant|>"
    _, want_first = reference(llava, first_text, [img])
    _, want_other = reference(llava, other_text, [img])
    eng = make_vlm()
    assert eng.generate(input_ids=ids(llava, first_text), sampling_params=G, image_data=img)["output_ids"] == want_first
    calls = tower_calls(eng)
    assert eng.memory()["encoder_cache_bytes"] == IMAGE and eng.memory()["encoder_cache_entries"] == 1
    out = eng.generate(input_ids=ids(llava, other_text), sampling_params=G, image_data=img)
    assert out["output_ids"] == want_other
    assert out["meta_info"]["cached_tokens"] < 12  # another prefix: the KV is not reused, the encoding is
    assert tower_calls(eng) == calls
    assert eng.core.runner.images.cache_hits == 1
    other = eng.generate(input_ids=ids(llava, other_text), sampling_params=G, image_data=tiny_image(22))
    assert other["output_ids"] == reference(llava, other_text, [tiny_image(22)])[1]
    assert tower_calls(eng) == calls + 1  # another image is encoded


def test_budget_evicts_least_recently_used_and_flush_drops_all(llava, make_vlm):
    eng = make_vlm(encoder_cache_bytes=2 * IMAGE + 100)
    a, b, c = tiny_image(31), tiny_image(32), tiny_image(33)
    calls = tower_calls(eng)
    # Each behind other text (no prefix hit); a used again before c: b the least recently used.
    prefixes = ["<|user|>one <image></s><|assistant|>", "<|user|>two two <image></s><|assistant|>",
                "<|user|>three three three <image></s><|assistant|>", "<|user|>four <image> four</s><|assistant|>"]  # fmt: skip
    for text, im in zip(prefixes, (a, b, a, c)):
        eng.generate(input_ids=ids(llava, text), sampling_params=G, image_data=im)
    assert tower_calls(eng) == calls + 3  # a's second time from the cache
    books = eng.core.scheduler.images.cache
    assert eng.memory()["encoder_cache_bytes"] == 2 * IMAGE <= books.budget
    assert books.evictions == 1
    eng.generate(input_ids=ids(llava, prefixes[1] + " "), sampling_params=G, image_data=b)
    assert tower_calls(eng) == calls + 4  # b was the one evicted
    eng.generate(input_ids=ids(llava, prefixes[2] + " "), sampling_params=G, image_data=c)
    assert tower_calls(eng) == calls + 4  # c kept
    assert eng.flush_cache()
    eng.run_until_idle()
    assert eng.memory()["encoder_cache_entries"] == 0 and not eng.core.runner.images.cache


def test_an_aborted_request_leaves_only_the_cache_entry(llava, make_vlm):
    eng = make_vlm(chunked_prefill_size=8, encoder_cache_bytes=IMAGE)
    rid = eng.add_request(ids(llava, ONE), G, image_data=tiny_image(41))
    for _ in range(2):
        eng.step()  # the image's first tokens prefilled: held for the request, and in the cache
    assert eng.memory()["image_embed_tokens"] == 36 and eng.memory()["encoder_cache_bytes"] == IMAGE
    eng.abort(rid)
    eng.run_until_idle()
    assert eng.memory()["image_embed_tokens"] == 0
    assert eng.memory()["encoder_cache_entries"] == 1  # the cache's own, within its budget
    # A second image takes the budget's room: the first one goes.
    eng.generate(input_ids=ids(llava, ONE), sampling_params=G, image_data=tiny_image(42))
    assert eng.memory()["encoder_cache_bytes"] == IMAGE and eng.core.scheduler.images.cache.evictions == 1
