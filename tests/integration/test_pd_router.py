"""PD disaggregation behind SGLang's own router: ``--pd-disaggregation --prefill URL BOOTSTRAP_PORT
--decode URL`` drives a kvledger prefill server and a kvledger decode server (different page sizes,
so the transfer is token-granular). Greedy fp32 output through the router equals a whole request's
on one server, for /generate and /v1/chat/completions, streamed and not; health checks on both sides
(SGLang's fake room) leak nothing; bad rendezvous fields are 400s that hold nothing; a room whose
other half never comes times out on either side and frees. Both servers' books clean after each."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time

import httpx
import openai
import pytest
import torch

from kvledger.disagg.mooncake import available as mooncake_missing
from tests import openai_suite
from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Router, Server, free_port

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")

TIMEOUT_S = "3"  # both sides' transfer timeouts, short so the fault tests are quick


def pd_servers(model: str, logs):
    """A fixture's body: a prefill and a decode server of ``model`` (pages of 16 and 4) behind SGLang's
    router in round robin; ``(prefill, decode, router, bootstrap port)``; all stopped after."""
    bport = free_port()
    pre = Server(model, *ENGINE_ARGS, "--disaggregation-mode", "prefill",
                 "--disaggregation-bootstrap-port", str(bport), "--disaggregation-bootstrap-timeout", TIMEOUT_S,
                 log_path=str(logs / "prefill.log"))  # fmt: skip
    dec = Server(model, *ENGINE_ARGS, "--page-size", "4", "--disaggregation-mode", "decode",
                 "--disaggregation-waiting-timeout", TIMEOUT_S, "--disaggregation-prefill-peers", f"127.0.0.1:{bport}",
                 log_path=str(logs / "decode.log"))  # fmt: skip
    router = None
    try:
        pre.wait_healthy()
        dec.wait_healthy()
        router = Router(["--pd-disaggregation", "--prefill", pre.url, str(bport), "--decode", dec.url,
                         "--policy", "round_robin"], str(logs / "router.log"))  # fmt: skip
        yield pre, dec, router, bport
    finally:
        if router is not None:
            router.stop()
        for s in (pre, dec):
            s.stop()


@pytest.fixture(scope="module")
def pd_pair(chat_model, tmp_path_factory):
    yield from pd_servers(chat_model, tmp_path_factory.mktemp("pd"))


def pd_stats(s: Server) -> dict:
    return s.info()["disaggregation"]


def clean(*servers: Server) -> None:
    for s in servers:
        s.wait_idle_clean(timeout=15)


PROMPTS = ["Hello there", "A longer prompt that crosses a few pages of the decode side's pool " * 3]


def test_the_openai_client_suite_through_the_pd_router(pd_pair):
    """Issue 56: the OpenAI-client suite's parts that SGLang's router serves in PD mode (chat and
    completions, streamed and not, n > 1). The router answers the Responses API and /v1/embeddings
    itself with 501 in PD mode and lists models in its own shape: those parts run against the single
    server and the --dp-size front (test_openai_suite.py, test_dp_sessions.py)."""
    pre, dec, router, _ = pd_pair
    openai_suite.run(router.url, parts=(openai_suite.chat, openai_suite.completions))
    clean(pre, dec)


def test_output_through_the_router_equals_one_server(pd_pair):
    pre, dec, router, _ = pd_pair
    before = pd_stats(dec)["transfers_ok"]
    for text in PROMPTS:
        body = {"text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
        whole = httpx.post(dec.url + "/generate", json=body, timeout=60).json()  # no room: served whole
        via = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert via.status_code == 200, via.text
        assert via.json()["output_ids"] == whole["output_ids"] and via.json()["text"] == whole["text"]
        streamed = httpx.post(router.url + "/generate", json={**body, "stream": True}, timeout=60)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        last = [ln for ln in streamed.text.splitlines() if ln.startswith("data: {")][-1]
        assert httpx.Response(200, content=last[6:]).json()["output_ids"] == whole["output_ids"]
    direct = openai.OpenAI(base_url=dec.url + "/v1", api_key="none", max_retries=0)
    routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Tell me about pages"}]
    kw = {"model": "default", "messages": msgs, "max_tokens": 10, "temperature": 0}
    want = direct.chat.completions.create(**kw).choices[0].message.content
    assert routed.chat.completions.create(**kw).choices[0].message.content == want
    parts = [
        c.choices[0].delta.content or ""
        for c in routed.chat.completions.create(**kw, stream=True)
        if c.choices
    ]
    assert "".join(parts) == want
    comp = routed.completions.create(model="default", prompt="Once", max_tokens=6, temperature=0)
    assert (
        comp.choices[0].text
        == direct.completions.create(model="default", prompt="Once", max_tokens=6, temperature=0)
        .choices[0]
        .text
    )
    st = pd_stats(dec)
    assert st["transfers_ok"] - before == 2 * len(PROMPTS) + 3 and st["frames_refused"] == 0, st
    assert pd_stats(pre)["transfers_ok"] >= st["transfers_ok"]
    metrics = httpx.get(dec.url + "/metrics").text
    assert 'kvledger_pd_transfers{result="ok"}' in metrics
    clean(pre, dec)


def test_a_five_turn_chat_through_the_router_equals_one_server(pd_pair):
    """A conversation as a chat client sends it (the whole history each turn): fp32 greedy answers
    through the router equal the decode server's own (no room: served whole, as one server), every
    later turn moves only what decode's prefix cache lacks, and the prompt's usage is one server's."""
    pre, dec, router, _ = pd_pair
    routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    whole = openai.OpenAI(base_url=dec.url + "/v1", api_key="none", max_retries=0)
    hist: list[dict] = []
    for k, text in enumerate(["Hi there", "Tell me more", "Why is that", "And then what", "Sum it up"]):
        hist.append({"role": "user", "content": text})
        kw = {"model": "default", "messages": hist, "max_tokens": 12, "temperature": 0}
        moved = pd_stats(dec)["tokens"]
        got = routed.chat.completions.create(**kw)
        moved = pd_stats(dec)["tokens"] - moved
        want = whole.chat.completions.create(**kw)
        assert got.choices[0].message.content == want.choices[0].message.content, k
        assert got.usage.prompt_tokens == want.usage.prompt_tokens, k
        cached = got.usage.prompt_tokens_details.cached_tokens
        # Decode's cache holds every prompt prefill's does (it also served each turn whole), so what
        # a cache served is decode's own match, and the transfer moved exactly the rest.
        assert moved == got.usage.prompt_tokens - cached, (k, moved, got.usage)
        assert (cached > 0) == (k > 0), (k, got.usage)
        hist.append({"role": "assistant", "content": got.choices[0].message.content})
    clean(pre, dec)


def test_health_generate_on_both_sides_leaks_nothing(pd_pair):
    """Seed 003: SGLang's PD health check (fake bootstrap host 2.2.2.2, room 0) on the decode side
    ends on the prebuilt path; on the prefill side it computes and sends nothing."""
    pre, dec, router, _ = pd_pair
    cached = dec.info()["memory"]["kv_cached_evictable"]
    for s in (pre, dec):
        for _ in range(3):
            assert httpx.get(s.url + "/health_generate", timeout=30).status_code == 200
    assert httpx.get(router.url + "/health_generate", timeout=30).status_code == 200
    clean(pre, dec)
    assert dec.info()["memory"]["kv_cached_evictable"] == cached  # fake KV is never cached
    for s in (pre, dec):
        assert s.info()["disaggregation_mode"] in ("prefill", "decode")


@pytest.mark.parametrize(
    "extra",
    [
        {"bootstrap_host": "127.0.0.1", "bootstrap_room": "12"},
        {"bootstrap_host": "127.0.0.1", "bootstrap_room": -1},
        {"bootstrap_host": "127.0.0.1", "bootstrap_room": 2**63},
        {"bootstrap_host": "", "bootstrap_room": 1},
        {"bootstrap_host": "127.0.0.1", "bootstrap_port": 70000, "bootstrap_room": 1},
        {"bootstrap_room": 5},
        {"bootstrap_host": ["127.0.0.1"], "bootstrap_room": [1, 2]},
    ],
)
def test_bad_rendezvous_fields_are_400_and_hold_nothing(pd_pair, extra):
    pre, dec, _, _ = pd_pair
    for s in (pre, dec):
        r = httpx.post(s.url + "/generate", json={"text": "hi", **extra}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"].startswith("bootstrap_"), err
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", **extra}, timeout=30)
        assert r.status_code == 400, r.text
    clean(pre, dec)


def test_a_bootstrap_host_that_is_not_an_allowed_peer_is_a_400_and_connects_nowhere(pd_pair):
    """SSRF (issue 50, item 9): the body names where decode fetches KV from. A host or port that is not
    one of its prefill peers is a 400 naming bootstrap_host on every route, streamed or not, before
    anything is held or connected (a listener at the named port sees no connection)."""
    pre, dec, _, bport = pd_pair
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(1.0)
    other = listener.getsockname()[1]
    try:
        for k, (host, port) in enumerate([("127.0.0.1", other), ("169.254.169.254", bport), ("localhost", other)]):
            rdv = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": 88000 + k}
            for route, body in [
                ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": True}),
                ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 2}),
                ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}]}),
            ]:
                r = httpx.post(dec.url + route, json={**body, **rdv}, timeout=30)
                assert r.status_code == 400, (route, r.text)
                err = r.json()["error"]
                assert err["param"] == "bootstrap_host" and "not a prefill server" in err["message"], err
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    clean(pre, dec)


def test_a_batch_takes_one_room_per_prompt(pd_pair):
    pre, dec, _, bport = pd_pair
    body = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": ["127.0.0.1", "127.0.0.1"], "bootstrap_port": [bport, bport],
            "bootstrap_room": [9001, 9002]}  # fmt: skip
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(httpx.post, pre.url + "/generate", json=body, timeout=60)
        fd = ex.submit(httpx.post, dec.url + "/generate", json=body, timeout=60)
        rp, rd = fp.result(), fd.result()
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    whole = httpx.post(
        dec.url + "/generate", json={k: body[k] for k in ("text", "sampling_params")}, timeout=60
    )
    assert [x["output_ids"] for x in rd.json()] == [x["output_ids"] for x in whole.json()]
    clean(pre, dec)


def test_the_other_half_never_comes_both_sides_time_out_and_free(pd_pair):
    pre, dec, _, bport = pd_pair
    before_d, before_p = pd_stats(dec), pd_stats(pre)
    rendezvous = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport}
    # Decode only: prefill never gets the request, so nothing is ever sent -> 502 after the timeout.
    r = httpx.post(
        dec.url + "/generate",
        json={"text": "lonely decode", "bootstrap_room": 77001, **rendezvous},
        timeout=60,
    )
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "kv_transfer_error" and "timed out" in r.json()["error"]["message"]
    # Prefill only: it waits (holding nothing) for a decode side to claim the room -> 502 after the timeout.
    r = httpx.post(
        pre.url + "/generate",
        json={"text": "lonely prefill", "bootstrap_room": 77002, **rendezvous},
        timeout=60,
    )
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["type"] == "kv_transfer_error" and "no decode server claimed" in err["message"], err
    clean(pre, dec)
    assert pd_stats(dec)["transfers_timed_out"] == before_d["transfers_timed_out"] + 1
    assert pd_stats(pre)["transfers_timed_out"] == before_p["transfers_timed_out"] + 1


def test_client_disconnect_while_kv_is_awaited_frees(pd_pair):
    pre, dec, _, bport = pd_pair
    body = {
        "text": "gone soon",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bport,
        "bootstrap_room": 77003,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(dec.url + "/generate", json=body, timeout=0.5)
    clean(pre, dec)


def test_abort_request_during_the_wait_frees(pd_pair):
    pre, dec, _, bport = pd_pair
    body = {"text": "abort me", "rid": "pd-abort-1", "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
            "bootstrap_room": 77004}  # fmt: skip
    with cf.ThreadPoolExecutor(1) as ex:
        f = ex.submit(httpx.post, dec.url + "/generate", json=body, timeout=60)
        time.sleep(0.5)
        assert (
            httpx.post(dec.url + "/abort_request", json={"rid": "pd-abort-1"}, timeout=10).status_code == 200
        )
        r = f.result()
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    clean(pre, dec)


@pytest.mark.skipif(bool(mooncake_missing()), reason=str(mooncake_missing()))
def test_a_mooncake_pair_through_the_router(chat_model, tmp_path):
    """The same pair with Mooncake's transfer engine moving the KV (TCP, P2P handshake)."""
    bport = free_port()
    mc = ("--disaggregation-transfer-backend", "mooncake")
    pre = Server(chat_model, *ENGINE_ARGS, *mc, "--disaggregation-mode", "prefill",
                 "--disaggregation-bootstrap-port", str(bport), log_path=str(tmp_path / "prefill.log"))  # fmt: skip
    dec = Server(chat_model, *ENGINE_ARGS, *mc, "--page-size", "4", "--disaggregation-mode", "decode",
                 "--disaggregation-prefill-peers", f"127.0.0.1:{bport}", log_path=str(tmp_path / "decode.log"))  # fmt: skip
    router = None
    try:
        pre.wait_healthy()
        dec.wait_healthy()
        router = Router(["--pd-disaggregation", "--prefill", pre.url, str(bport), "--decode", dec.url],
                        str(tmp_path / "router.log"))  # fmt: skip
        for text in PROMPTS:
            body = {
                "text": text,
                "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
            }
            whole = httpx.post(dec.url + "/generate", json=body, timeout=60).json()
            via = httpx.post(router.url + "/generate", json=body, timeout=60)
            assert via.status_code == 200 and via.json()["output_ids"] == whole["output_ids"], via.text
        routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        kw = {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        want = openai.OpenAI(base_url=dec.url + "/v1", api_key="none").chat.completions.create(**kw)
        parts = [
            c.choices[0].delta.content or ""
            for c in routed.chat.completions.create(**kw, stream=True)
            if c.choices
        ]
        assert "".join(parts) == want.choices[0].message.content
        st = pd_stats(dec)
        assert st["transfers_ok"] == len(PROMPTS) + 1 and st["kv_frames"] == 0, st  # Mooncake moved it all
        assert httpx.get(dec.url + "/health_generate", timeout=30).status_code == 200
        clean(pre, dec)
    finally:
        if router is not None:
            router.stop()
        for s in (pre, dec):
            s.stop()


def test_session_turns_through_the_router(pd_pair):
    """A streaming session through PD: router 0.3.2 does not forward ``/open_session`` (404 from the
    router), so the session is opened on the decode server and its turns go through the router, which
    posts the same body (input + session_params) to both sides. Each turn equals the same session's
    turn served whole on the decode server (fp32 greedy), a later turn moves only what the session's
    KV lacks and reports that KV as cached; a turn too long for the context is decode's 400 and ends
    prefill's half at once (no bootstrap timeout), an aborted turn leaves the session as it was, and
    closing on decode frees it. Both sides' books clean."""
    pre, dec, router, _ = pd_pair
    r = httpx.post(router.url + "/open_session", json={}, timeout=30)
    assert r.status_code == 404, (r.status_code, r.text)  # what router 0.3.2 does today
    sid = httpx.post(dec.url + "/open_session", json={}, timeout=30).json()
    ref = httpx.post(dec.url + "/open_session", json={}, timeout=30).json()  # served whole: the reference
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    def turn(text: str, session: str, url: str, **kw) -> httpx.Response:
        body = {"text": text, "sampling_params": sp, "session_params": {"id": session}, **kw}
        return httpx.post(url + "/generate", json=body, timeout=60)

    def one_turn(k: int, text: str) -> None:
        want = turn(text, ref, dec.url).json()
        before = pd_stats(dec)["tokens"]
        via = turn(text, sid, router.url)
        assert via.status_code == 200, via.text
        got = via.json()
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], k
        meta, wmeta = got["meta_info"], want["meta_info"]
        assert meta["prompt_tokens"] == wmeta["prompt_tokens"], (meta, wmeta)
        assert meta["cached_tokens"] == wmeta["cached_tokens"], (meta, wmeta)
        moved = pd_stats(dec)["tokens"] - before
        assert moved == meta["prompt_tokens"] - meta["cached_tokens"], (k, moved, meta)
        if k:
            assert meta["cached_tokens"] > 0 and moved <= len(text) + 4, (k, moved, meta)

    one_turn(0, "The first turn of a session")
    one_turn(1, " and then a second turn")
    session = next(s for s in dec.info()["sessions"] if s["id"] == sid)
    timeouts = pd_stats(pre)["transfers_timed_out"]
    # Too long: the conversation would pass the context (1024); the input alone would not.
    t0 = time.monotonic()
    r = turn("y" * 1000, sid, router.url)
    # The router answers decode's 400 in its own shape (code decode_bad_request), with our message.
    assert r.status_code == 400, (r.status_code, r.text)
    assert "the context is 1024" in r.json()["error"]["message"], r.text
    # Abort a turn on decode (/abort_request by the rid the router passes to both sides).
    long_sp = {**sp, "max_new_tokens": 600}
    body = {"text": " abort me", "sampling_params": long_sp, "session_params": {"id": sid}, "rid": "pd-sess-x"}
    with cf.ThreadPoolExecutor(1) as ex:
        f = ex.submit(httpx.post, router.url + "/generate", json=body, timeout=60)
        deadline = time.monotonic() + 30
        while not any(s["busy_rid"] == "pd-sess-x" for s in dec.info()["sessions"]):
            assert time.monotonic() < deadline and not f.done(), "the turn never reached decode"
            time.sleep(0.02)
        a = httpx.post(dec.url + "/abort_request", json={"rid": "pd-sess-x"}, timeout=10)
        assert a.status_code == 200, a.text
        r = f.result()
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.text
    clean(pre, dec)
    assert time.monotonic() - t0 < 30
    assert pd_stats(pre)["transfers_timed_out"] == timeouts  # prefill's halves were told, not timed out
    assert next(s for s in dec.info()["sessions"] if s["id"] == sid) == session  # as turn 2 left it
    one_turn(2, " a third turn, streamed or not, the same")
    streamed = httpx.post(router.url + "/generate", json={"text": " four", "sampling_params": sp,
                          "session_params": {"id": sid}, "stream": True}, timeout=60)  # fmt: skip
    want = turn(" four", ref, dec.url).json()
    last = [ln for ln in streamed.text.splitlines() if ln.startswith("data: {")][-1]
    assert httpx.Response(200, content=last[6:]).json()["output_ids"] == want["output_ids"]
    for s in (sid, ref):
        assert httpx.post(dec.url + "/close_session", json={"session_id": s}, timeout=30).status_code == 200
    assert pre.info()["sessions"] == []
    clean(pre, dec)
    assert dec.info()["memory"]["kv_session"] == 0


def test_a_pair_with_tiers_and_a_draft_model_through_the_router(chat_model, srv, tmp_path):
    """Both servers with the hierarchical cache (small pools, so prompts leave them for L2) and a
    draft model (the target itself: drafts nearly all accepted), behind the router. Greedy output
    equals one server's, turn after turn; a prompt prefill's pool dropped is loaded from its L2 and
    counted as cached by the OpenAI client; both servers' books clean, L2 included. The one server
    is the session's (``srv``: the same model and ENGINE_ARGS, its books checked after the test): a
    server of its own here cost one more start, ~15 s of the suite on 2 cores, for the same answers."""
    bport = free_port()
    both = ("--max-total-tokens", "256", "--enable-hierarchical-cache", "--hicache-ratio", "8",
            "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", chat_model)  # fmt: skip
    pre = Server(chat_model, *ENGINE_ARGS, *both, "--disaggregation-mode", "prefill",
                 "--disaggregation-bootstrap-port", str(bport), log_path=str(tmp_path / "prefill.log"))  # fmt: skip
    dec = Server(chat_model, *ENGINE_ARGS, *both, "--page-size", "4", "--disaggregation-mode", "decode",
                 "--disaggregation-prefill-peers", f"127.0.0.1:{bport}", log_path=str(tmp_path / "decode.log"))  # fmt: skip
    router = None
    try:
        for s in (pre, dec):
            s.wait_healthy()
        router = Router(["--pd-disaggregation", "--prefill", pre.url, str(bport), "--decode", dec.url],
                        str(tmp_path / "router.log"))  # fmt: skip
        routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        plain = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        topics = [f"Topic {i}: " + f"tell me everything about item number {i} " * 6 for i in range(6)]
        usages = []
        for content in [*topics, topics[0]]:
            kw = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                  "temperature": 0}  # fmt: skip
            got = routed.chat.completions.create(**kw)
            assert got.choices[0].message.content == plain.chat.completions.create(**kw).choices[0].message.content
            usages.append(got.usage)
        assert usages[0].prompt_tokens_details.cached_tokens == 0
        assert usages[-1].prompt_tokens_details.cached_tokens >= 64, usages[-1]
        assert pre.info()["memory"]["hicache"]["l2_hit_tokens"] >= 64
        assert dec.info()["memory"]["hicache"]["backed_up_pages"] > 0  # received KV entered its tiers
        assert pd_stats(dec)["transfers_ok"] == len(topics) + 1
        clean(pre, dec)  # (srv's own check runs at teardown)
    finally:
        if router is not None:
            router.stop()
        for s in (pre, dec):
            s.stop()


def test_images_through_the_pd_router(llava, tmp_path):
    """A tiny LLaVA as a PD pair behind SGLang's router: chat ``image_url`` parts (streamed and not) and
    ``/generate`` ``image_data`` reach both sides, and the answer is transformers' (fp32 greedy); both
    sides' books clean, no image embedding held."""
    from tests.helpers import tiny_image
    from tests.integration.test_vision_server import ask, data_url, reference

    pair = pd_servers(llava[0], tmp_path)
    pre, dec, router, _ = next(pair)
    try:
        img = tiny_image(13)
        want, n = reference(llava, ["what is ", img, " here"])
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        r = ask(c, ["what is ", data_url(img), " here"])
        assert r.choices[0].message.content == want and r.usage.prompt_tokens == n
        text, usage = ask(c, ["what is ", data_url(img), " here"], stream=True)
        assert text == want and usage.prompt_tokens == n
        _, proc, ref = llava
        inputs = proc(text="look <image> now", images=[img], return_tensors="pt")
        with torch.no_grad():
            out = ref.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                               eos_token_id=None)  # fmt: skip
        body = {"text": "look <image> now", "image_data": [data_url(img)],
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        g = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert g.status_code == 200, g.text
        assert g.json()["output_ids"] == out[0, inputs["input_ids"].shape[1] :].tolist()
        assert pd_stats(dec)["transfers_ok"] >= 3
        for s in (pre, dec):
            assert s.wait_idle_clean(timeout=15)["memory"].get("image_embed_tokens", 0) == 0
    finally:
        pair.close()  # (the generator's own finally stops the router and both servers)
