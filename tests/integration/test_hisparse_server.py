"""HiSparse on a PD decode server behind SGLang's router (issue 31): seed 003's health check on the
decode side x 50 with HiSparse on (it takes host and hot pages at admission and ends on the prebuilt
path: the release must give them back), plain and with NGRAM drafts; greedy fp32 output through the
router with every page selected equals the decode server's own (served whole: dense sums); the page map names the hot pages live."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Router, Server, free_port

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")

# Every request sparse; every page selected for prompts up to 60 pages (so fp32 output is dense's).
HISPARSE = ("--enable-hisparse", "--hisparse-min-context", "0", "--hisparse-top-k-pages", "60",
            "--hisparse-hot-pages", "64")  # fmt: skip


@pytest.mark.parametrize("spec", [(), ("--speculative-algorithm", "NGRAM")], ids=["plain", "ngram"])
def test_health_generate_on_a_hisparse_decode_server_leaks_nothing(chat_model, tmp_path, spec):
    bport = free_port()
    pre = Server(chat_model, *ENGINE_ARGS, *spec, "--disaggregation-mode", "prefill",
                 "--disaggregation-bootstrap-port", str(bport), log_path=str(tmp_path / "prefill.log"))  # fmt: skip
    dec = Server(chat_model, *ENGINE_ARGS, *spec, *HISPARSE, "--disaggregation-mode", "decode",
                 "--disaggregation-prefill-peers", f"127.0.0.1:{bport}", log_path=str(tmp_path / "decode.log"))  # fmt: skip
    router = None
    try:
        for s in (pre, dec):
            s.wait_healthy()
        router = Router(["--pd-disaggregation", "--prefill", pre.url, str(bport), "--decode", dec.url],
                        str(tmp_path / "router.log"))  # fmt: skip
        text = "A longer prompt that crosses a few pages of the decode side's pool " * 4
        body = {"text": text, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
        via = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert via.status_code == 200, via.text
        # Without a room the decode server serves it whole (every page selected: dense attention's sums).
        assert via.json()["output_ids"] == httpx.post(dec.url + "/generate", json=body, timeout=60).json()["output_ids"]
        for _ in range(50):  # seed 003: the fake room, the prebuilt finish, HiSparse's pages
            assert httpx.get(dec.url + "/health_generate", timeout=30).status_code == 200
        for _ in range(5):
            assert httpx.get(router.url + "/health_generate", timeout=30).status_code == 200
        info = dec.wait_idle_clean(timeout=15)  # (books_balance: no host or hot page held)
        sparse = info["memory"]["hisparse"]
        assert sparse["host_held"] == 0 and info["memory"]["kv_hisparse_hot"] == 0, sparse
        assert sparse["requests_begun"] >= 1  # the routed request decoded sparsely
        assert info["memory"]["leak_check"]["violations"] == 0
        pre.wait_idle_clean(timeout=15)
    finally:
        if router is not None:
            router.stop()
        for s in (pre, dec):
            s.stop()


def test_the_page_map_shows_hot_pages_while_a_request_decodes(chat_model, tmp_path):
    srv = Server(chat_model, *ENGINE_ARGS, "--enable-hisparse", "--hisparse-min-context", "64",
                 "--hisparse-top-k-pages", "2", "--hisparse-hot-pages", "6", log_path=str(tmp_path / "s.log"))  # fmt: skip
    try:
        srv.wait_healthy()
        body = {"text": "pages and more pages " * 20,
                "sampling_params": {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, srv.url + "/generate", json=body, timeout=120)
            seen = None
            while seen is None and not fut.done():
                runs = httpx.get(srv.url + "/memory/pages", timeout=10).json()["runs"]
                seen = [x for x in runs if x["kind"] == "hisparse_hot"] or None
            res = fut.result()
            assert res.status_code == 200, res.text
        assert seen and sum(x["count"] for x in seen) == 6, seen
        assert all(x["owner"].endswith("[hisparse hot]") for x in seen)
        srv.wait_idle_clean(timeout=15)
    finally:
        srv.stop()
