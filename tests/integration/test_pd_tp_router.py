"""PD x tensor parallel as a user runs it: ``kvledger serve --tp-size 2`` on both sides of a PD pair
behind SGLang's router (two engines of two ranks each; one process holds one TP group, so the 2/2
pair cannot run in one test process -- tests/engine/test_disagg_tp.py runs 1/2 and 2/1 there). fp32
greedy output through the router equals one plain engine's; both servers' books clean after."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvledger import Engine
from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Router, Server, free_port

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")


def test_tp2_prefill_and_tp2_decode_through_the_router_equal_one_engine(chat_model, tmp_path):
    bport = free_port()
    tp = ("--tp-size", "2")
    pre = Server(chat_model, *ENGINE_ARGS, *tp, "--disaggregation-mode", "prefill",
                 "--disaggregation-bootstrap-port", str(bport), log_path=str(tmp_path / "prefill.log"))  # fmt: skip
    dec = Server(chat_model, *ENGINE_ARGS, *tp, "--page-size", "4", "--disaggregation-mode", "decode",
                 "--disaggregation-prefill-peers", f"127.0.0.1:{bport}", log_path=str(tmp_path / "decode.log"))  # fmt: skip
    router = None
    one = Engine(model=chat_model, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    try:
        pre.wait_healthy()
        dec.wait_healthy()
        assert pre.info()["engine"]["tp_size"] == dec.info()["engine"]["tp_size"] == 2
        router = Router(["--pd-disaggregation", "--prefill", pre.url, str(bport), "--decode", dec.url],
                        str(tmp_path / "router.log"))  # fmt: skip
        prompts = [[7, 8, 9], [(5 * i) % 250 + 3 for i in range(90)]]  # the second crosses chunks of 64
        sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
        for ids in prompts:
            want = one.generate(input_ids=ids, sampling_params=sp)["output_ids"]
            via = httpx.post(router.url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=60)
            assert via.status_code == 200, via.text
            assert via.json()["output_ids"] == want
        kw = {"model": "default", "messages": [{"role": "user", "content": "Tell me about heads"}],
              "max_tokens": 8, "temperature": 0}  # fmt: skip
        routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        direct = openai.OpenAI(base_url=dec.url + "/v1", api_key="none", max_retries=0)  # served whole
        parts = [c.choices[0].delta.content or "" for c in routed.chat.completions.create(**kw, stream=True)
                 if c.choices]  # fmt: skip
        assert "".join(parts) == direct.chat.completions.create(**kw).choices[0].message.content
        st = dec.info()["disaggregation"]
        assert st["transfers_ok"] == len(prompts) + 1 and st["frames_refused"] == 0, st
        assert st["staged_peak_bytes"] > 0 and st["staged_bytes"] == 0, st
        assert "kvledger_pd_staged_bytes 0.0" in httpx.get(dec.url + "/metrics").text
        for s in (pre, dec):
            s.wait_idle_clean(timeout=15)
        assert pre.info()["disaggregation"]["staged_bytes"] == 0
    finally:
        if router is not None:
            router.stop()
        for s in (pre, dec):
            s.stop()
        one.shutdown()
