"""Images in, the second family: tiny random Qwen2-VL and Qwen2.5-VL (dynamic resolution: an
image's token count follows its size; M-RoPE: three positions a token, the text after an image
offset by it) token-exact against transformers in float32 with one image unchunked and with chunked
prefill splitting it, two images of different sizes batched beside a text request, the prefix cache
keyed by image content (a hit ending inside or after an image gives the same positions), a
retracted request's re-prefill; the layout's positions against transformers' ``get_rope_index``.
Strict engines, audited clean (books, held embeddings) at teardown."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_vision import vlm_engines
from tests.helpers import tiny_image

G = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"<|user|>look {IMG} and say</s><|assistant|>"
TWO = f"<|user|>first {IMG} then {IMG} compare</s><|assistant|>"


@pytest.fixture
def make_vlm(qwen_vl):
    yield from vlm_engines(qwen_vl[0])


def ids(qwen_vl, text: str) -> list[int]:
    return qwen_vl[2](text)["input_ids"]


def ref_inputs(qwen_vl, text: str, images: list) -> dict:
    """transformers' inputs: the image processor's patches and grids, each ``<|image_pad|>``
    repeated for its image's tokens (the grid's product over the 2x2 merge, as Qwen2VLProcessor
    counts them) and the token types M-RoPE reads."""
    _, image_proc, tok, _ = qwen_vl
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    px = image_proc(images=images, return_tensors="pt")
    counts = iter((px["image_grid_thw"].prod(-1) // 4).tolist())
    prompt = []
    for t in tok(text)["input_ids"]:
        prompt.extend([pad] * next(counts) if t == pad else [t])
    input_ids = torch.tensor([prompt])
    return dict(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=px["pixel_values"],
        image_grid_thw=px["image_grid_thw"], mm_token_type_ids=(input_ids == pad).int(),
    )  # fmt: skip


@torch.no_grad()
def reference(qwen_vl, text: str, images: list, n: int = 8, logprobs: bool = False):
    """transformers' prompt and greedy continuation (with ``logprobs``: and each token's logprob)."""
    inputs = ref_inputs(qwen_vl, text, images)
    out = qwen_vl[3].generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                              eos_token_id=None, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    prompt = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt) :].tolist()
    if not logprobs:
        return prompt, tokens
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return prompt, tokens, lps


def assert_logprobs(out: dict, want: list[float]) -> None:
    """The engine's logprob of each token it chose is transformers' (float32: to float noise): a
    token's position (its image's grid, the offset after it) off by one moves them far more."""
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert np.allclose(got, want, atol=2e-4), (got, want)


def test_layout_positions_are_transformers_rope_index(qwen_vl, make_vlm):
    """Every token's three positions, chunk by chunk from any start, and the decode offset, against
    ``get_rope_index`` over the whole prompt (two images of different sizes, the second one's grid
    taller than wide)."""
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    inputs = ref_inputs(qwen_vl, TWO, [a, b])
    want, delta = qwen_vl[3].model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    want = want[:, 0].numpy()
    eng = make_vlm()
    prompt = ids(qwen_vl, TWO)
    mm = eng._images([a, b], [prompt], True)[0]  # (the placeholders expanded in place)
    req = eng.core.make_request(prompt, G, mm=mm)
    assert req.input_ids == inputs["input_ids"][0].tolist()
    rope = req.mm.rope
    assert [g.length for g in rope.grids] == [30, 32]  # dynamic resolution: the size sets the count
    n = len(req.input_ids)
    assert rope.delta == int(delta) and rope.delta < 0
    for step in (1, 5, 16, n):
        got = []
        for s in range(0, n, step):
            off, pos = rope.chunk(s, min(n, s + step))
            got.append(pos if pos is not None else np.arange(s, min(n, s + step))[None].repeat(3, 0) + off)
        assert (np.concatenate(got, axis=1) == want).all(), step
    eng.core.drop_request(req)


@pytest.mark.parametrize("chunk,overlap", [(None, False), (16, False), (5, False), (16, True)])
def test_one_image_token_exact(qwen_vl, make_vlm, chunk, overlap):
    """(``overlap``: each step scheduled while the previous one runs: the rows' positions come
    from their starts, known before the previous step's token is.)"""
    img = tiny_image(1)
    prompt, want, lps = reference(qwen_vl, ONE, [img], logprobs=True)
    eng = make_vlm(disable_overlap_schedule=not overlap, **({"chunked_prefill_size": chunk} if chunk else {}))
    out = eng.generate(input_ids=ids(qwen_vl, ONE), sampling_params={**G, "logprobs": True}, image_data=img)
    assert out["output_ids"] == want
    assert_logprobs(out, lps)
    assert out["meta_info"]["prompt_tokens"] == len(prompt)  # the image's 30 tokens counted


def test_two_images_of_different_sizes_token_exact_batched_beside_text(qwen_vl, make_vlm):
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    _, want_two, lps_two = reference(qwen_vl, TWO, [a, b], logprobs=True)
    _, want_one, lps_one = reference(qwen_vl, ONE, [b], logprobs=True)
    eng = make_vlm(chunked_prefill_size=32)
    text = list(range(3, 60))
    with torch.no_grad():  # a text-only request: plain positions (M-RoPE's three equal)
        ref = qwen_vl[3].generate(torch.tensor([text]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)  # fmt: skip
    outs = eng.generate(
        input_ids=[ids(qwen_vl, TWO), text, ids(qwen_vl, ONE)], sampling_params={**G, "logprobs": True},
        image_data=[[a, b], None, b],
    )  # fmt: skip
    assert [o["output_ids"] for o in outs] == [want_two, ref[0, len(text) :].tolist(), want_one]
    assert_logprobs(outs[0], lps_two)
    assert_logprobs(outs[2], lps_one)
    assert eng.core.runner.images.encoded == 2  # b once: the encoder cache (or the step's batch) has it


def test_same_image_reuses_its_kv_with_the_same_positions(qwen_vl, make_vlm):
    """A prefix-cache hit that ends after the image (the whole prompt but its last token) and one
    that ends inside it (a shared page boundary in the image's run) give transformers' tokens."""
    a, b = tiny_image(1), tiny_image(2)
    _, want_a = reference(qwen_vl, ONE, [a])
    _, want_b = reference(qwen_vl, ONE, [b])
    eng = make_vlm()
    p = ids(qwen_vl, ONE)
    first = eng.generate(input_ids=p, sampling_params=G, image_data=a)
    assert first["meta_info"]["cached_tokens"] == 0 and first["output_ids"] == want_a
    again = eng.generate(input_ids=p, sampling_params=G, image_data=a)
    assert again["output_ids"] == want_a
    n = again["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] == (n - 1) // 4 * 4
    other = eng.generate(input_ids=p, sampling_params=G, image_data=b)
    assert other["output_ids"] == want_b
    assert other["meta_info"]["cached_tokens"] < p.index(qwen_vl[2].convert_tokens_to_ids("<|image_pad|>")) + 4
    # A hit that ends in the text after the image: a longer prompt sharing the image.
    longer = ONE.replace(" and say", " and say it twice")
    _, want_long = reference(qwen_vl, longer, [a])
    out = eng.generate(input_ids=ids(qwen_vl, longer), sampling_params=G, image_data=a)
    assert out["output_ids"] == want_long and out["meta_info"]["cached_tokens"] > 37
    # A hit that ends inside the image: a request aborted after three chunks of 8 left its pages.
    c = tiny_image(6)
    _, want_c, lps_c = reference(qwen_vl, ONE, [c], logprobs=True)
    chunked = make_vlm(chunked_prefill_size=8)
    rid = chunked.add_request(list(p), G, image_data=c)
    for _ in range(3):
        chunked.step()
    chunked.abort(rid)
    chunked.run_until_idle()
    out = chunked.generate(input_ids=p, sampling_params={**G, "logprobs": True}, image_data=c)
    assert out["meta_info"]["cached_tokens"] == 24  # the image's run is [7, 37)
    assert out["output_ids"] == want_c
    assert_logprobs(out, lps_c)


def test_retracted_request_is_reprefilled_at_the_same_positions(qwen_vl, make_vlm):
    eng = make_vlm(chunked_prefill_size=8)
    img = tiny_image(4)
    _, want, lps = reference(qwen_vl, ONE, [img], logprobs=True)
    rid = eng.add_request(ids(qwen_vl, ONE), {**G, "logprobs": True}, image_data=img)
    for _ in range(2):
        eng.step()  # the image's first tokens prefilled: its embeddings wait for the rest
    assert eng.memory()["image_embed_tokens"] == 30
    req = eng.core.scheduler.reqs[rid]
    eng.core.scheduler.policy.retract(req)
    assert not eng.core.scheduler.images.held
    eng.run_until_idle()
    res = eng.result(rid)
    assert res["output_ids"] == want
    assert_logprobs(res, lps)
    # Retracted while decoding (past the image: re-prefilled with its output, then decoding on).
    rid = eng.add_request(ids(qwen_vl, ONE), G, image_data=img)
    while len(eng.core.scheduler.reqs[rid].output_ids) < 3:
        eng.step()
    eng.core.scheduler.policy.retract(eng.core.scheduler.reqs[rid])
    eng.run_until_idle()
    assert eng.result(rid)["output_ids"] == want


def test_ngram_drafts_verify_at_offset_positions(qwen_vl, make_vlm):
    """NGRAM drafts after an image: a verify row's drafts run past the sequence at the request's
    offset positions (the chunk's layout covers them); the tokens are transformers'."""
    img = tiny_image(1)
    _, want = reference(qwen_vl, ONE, [img], n=24)
    eng = make_vlm(speculative_algorithm="NGRAM")
    out = eng.generate(input_ids=ids(qwen_vl, ONE), sampling_params={**G, "max_new_tokens": 24}, image_data=img)
    assert out["output_ids"] == want
    assert out["meta_info"]["spec_verify_ct"] < 24  # drafts were accepted (the tiny model repeats itself)


TURN2 = f"<|user|>now {IMG} again</s><|assistant|>"
TURN3 = "<|user|>and so?</s><|assistant|>"


@torch.no_grad()
def reference_ids(qwen_vl, prompt: list[int], images: list, n: int = 8) -> list[int]:
    """transformers' greedy continuation of an expanded prompt (ids) whose image runs are ``images``."""
    _, image_proc, tok, ref = qwen_vl
    px = image_proc(images=images, return_tensors="pt")
    x = torch.tensor([prompt])
    mm = (x == tok.convert_tokens_to_ids("<|image_pad|>")).int()
    out = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=px["pixel_values"],
                       image_grid_thw=px["image_grid_thw"], mm_token_type_ids=mm, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
def test_session_turns_take_the_whole_conversations_positions(qwen_vl, make_vlm):
    """A session's turns: each turn's layout is the whole conversation's (the history's images, then
    its own moved past the history), so a text-only turn after an image turn, a turn whose history
    KV was dropped and is recomputed, and a rewind equal transformers on the whole conversation."""
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    eng = make_vlm()
    sid = eng.open_session()
    p1, want1 = reference(qwen_vl, ONE, [a])
    t1 = eng.generate(input_ids=ids(qwen_vl, ONE), sampling_params=G, image_data=a, session_params={"id": sid})
    assert t1["output_ids"] == want1
    history = p1 + want1 + ids(qwen_vl, TURN3)  # a text-only turn: its positions offset by the history's image
    want2 = reference_ids(qwen_vl, history, [a])
    t2 = eng.generate(input_ids=ids(qwen_vl, TURN3), sampling_params=G, session_params={"id": sid})
    assert t2["output_ids"] == want2 and t2["meta_info"]["cached_tokens"] >= len(p1)
    history += want2 + ref_inputs(qwen_vl, TURN2, [b])["input_ids"][0].tolist()
    want3 = reference_ids(qwen_vl, history, [a, b])
    t3 = eng.generate(input_ids=ids(qwen_vl, TURN2), sampling_params=G, image_data=b, session_params={"id": sid})
    assert t3["output_ids"] == want3
    assert eng.core.kv_manager.sessions.drop_all_kv() > 0  # recomputed from the tokens, both images again
    history += want3 + ids(qwen_vl, TURN3)
    t4 = eng.generate(input_ids=ids(qwen_vl, TURN3), sampling_params=G, session_params={"id": sid})
    assert t4["output_ids"] == reference_ids(qwen_vl, history, [a, b])
    back = len(p1) + len(want1)  # a rewind to after the first turn: its image only
    t5 = eng.generate(input_ids=ids(qwen_vl, TURN3), sampling_params=G, session_params={"id": sid, "offset": back})
    assert t5["output_ids"] == want2
    eng.close_session(sid)


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
def test_pd_decode_side_decodes_at_the_offset_positions(qwen_vl, make_vlm):
    """PD: decode takes prefill's KV of the prompt (computed at M-RoPE's positions) and decodes at
    the request's offset positions (its layout built from the same images): one engine's tokens."""
    from kvledger.common.disagg import DisaggParams
    from tests.engine.test_disagg import drive, until_idle
    from tests.server_harness import free_port

    port = free_port()
    pre = make_vlm(disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                   disaggregation_bind_host="127.0.0.1", page_size=16)  # fmt: skip
    dec = make_vlm(disaggregation_mode="decode", disaggregation_bootstrap_port=port, page_size=4)
    p = ids(qwen_vl, TWO)
    a, b = tiny_image(1), tiny_image(2, (30, 60))
    try:
        room = DisaggParams("127.0.0.1", port, 10)
        pre.add_request(p, G, rid="p0", disagg=room, image_data=[a, b])
        dec.add_request(p, G, rid="d0", disagg=room, image_data=[a, b])
        out = drive([pre, dec], {id(pre): ["p0"], id(dec): ["d0"]})["d0"]
        assert out["output_ids"] == reference(qwen_vl, TWO, [a, b])[1]
    finally:
        for eng in (pre, dec):
            eng.core.disagg_connector.timeout_s = 0.1
            until_idle(eng)
            eng.core.disagg_connector.close()


@pytest.mark.parametrize("qwen_vl", ["qwen2_vl"], indirect=True)
def test_decode_graphs_run_offset_rows_eager(qwen_vl, make_vlm):
    """CUDA graphs (the CPU's stand-in capture): a graph's positions also index the page table, so a
    decode row whose rope positions are offset by its images runs eager (reason ``mrope``); a
    text-only request's rows replay the graphs. Both transformers' tokens."""
    from kvledger.engine import graph_runner as gr
    from kvledger.engine.graph_capture import EagerCapture

    img = tiny_image(1)
    _, want = reference(qwen_vl, ONE, [img])
    eng = make_vlm(graph_capture=EagerCapture(), cuda_graph_max_bs=4)
    graphs = eng.core.runner.graphs
    assert eng.generate(input_ids=ids(qwen_vl, ONE), sampling_params=G, image_data=img)["output_ids"] == want
    assert graphs.eager_steps[gr.MROPE] == 7 and graphs.replays == 0  # every decode step after the prefill
    text = list(range(3, 40))
    with torch.no_grad():
        ref = qwen_vl[3].generate(torch.tensor([text]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert eng.generate(input_ids=text, sampling_params=G)["output_ids"] == ref[0, len(text) :].tolist()
    assert graphs.replays == 7
