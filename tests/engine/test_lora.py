"""Multi-LoRA (issue 34 item 4): adapters and the base model in one batch, each row with its own
adapter, greedy output equal to transformers + peft's merged model; the prefix cache namespaced by
adapter; ``--max-loras-per-batch``; loading, unloading (refused while in use) and bad input. Strict
engines, audited clean at teardown (``make_engine``)."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvledger.errors import ConflictError, NotFoundError, ValidationError
from kvledger.launch.validate import check_settings
from tests.helpers import build_lora_adapter, hf_greedy, peft_merged

N = 8
G = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
PROMPTS = [[5, 9, 23, 7, 100, 41], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [200, 17, 9], [77, 66, 55, 44, 33]]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Three adapters of the tiny Llama: attention only, every projection, and rank 8 with rsLoRA."""
    d = tmp_path_factory.mktemp("loras")
    return {
        "attn": build_lora_adapter(tiny_llama, str(d / "attn"), seed=1),
        "all": build_lora_adapter(tiny_llama, str(d / "all"), seed=2, r=2, targets=(
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        "mlp8": build_lora_adapter(tiny_llama, str(d / "mlp8"), seed=3, r=8, targets=("gate_proj", "down_proj"),
                                   rslora=True),
    }  # fmt: skip


@pytest.fixture(scope="module")
def references(tiny_llama, adapters) -> dict:
    """Greedy continuations of each prompt by the base model and by each adapter merged (peft)."""
    from tests.helpers import hf_model

    models = {None: hf_model(tiny_llama), **{n: peft_merged(tiny_llama, p) for n, p in adapters.items()}}
    return {(n, i): hf_greedy(m, p, N) for n, m in models.items() for i, p in enumerate(PROMPTS)}


def _paths(adapters) -> list[str]:
    return [f"{n}={p}" for n, p in adapters.items()]


def test_a_mixed_batch_matches_peft_merged_models(make_engine, adapters, references):
    """Every (adapter, prompt) pair and the base model's, all submitted at once: one forward mixes
    them (rows of four adapters, in turns), each row's output equal to its merged model's."""
    eng = make_engine(lora_paths=_paths(adapters))
    jobs = [(n, i) for n in (None, *adapters) for i in range(len(PROMPTS))]
    seen: list[set] = []
    build = eng.core.runner.build

    def spy(sched):
        b = build(sched)
        seen.append({r.lora for r in sched.reqs})
        return b

    eng.core.runner.build = spy
    outs = eng.generate(
        input_ids=[PROMPTS[i] for _, i in jobs],
        sampling_params=[{**G, "lora_path": n} if n else G for n, _ in jobs],
    )
    for (n, i), out in zip(jobs, outs):
        assert out["output_ids"] == references[(n, i)], (n, i)
    assert any(len(s) == 4 for s in seen)  # base and three adapters in one forward


def test_a_prefix_cached_under_one_adapter_is_never_served_to_another(make_engine, adapters, references):
    eng = make_engine(lora_paths=_paths(adapters), page_size=4)
    prompt = PROMPTS[1]  # 11 tokens: two whole pages can be cached
    for name in ("attn", "all", None, "mlp8"):
        out = eng.generate(input_ids=prompt, sampling_params={**G, "lora_path": name} if name else G)
        assert out["meta_info"]["cached_tokens"] == 0, name  # another adapter's KV is not a hit
        assert out["output_ids"] == references[(name, 1)], name
    for name in ("attn", "all", None, "mlp8"):
        out = eng.generate(input_ids=prompt, sampling_params={**G, "lora_path": name} if name else G)
        assert out["meta_info"]["cached_tokens"] == 8, name  # its own KV is
        assert out["output_ids"] == references[(name, 1)], name
    assert len(eng.core.kv_manager.tree.root.children) == 4  # one subtree per adapter and the base


def test_the_same_name_with_other_files_does_not_reuse_the_cache(make_engine, adapters, references, tmp_path):
    """The namespace is the adapter's files, not its name: reloaded under the same name from other
    files, nothing cached before is served; reloaded from the same files, it is."""
    eng = make_engine(enable_lora=True, page_size=4)
    eng.load_lora_adapter("x", adapters["attn"])
    sp = {**G, "lora_path": "x"}
    assert eng.generate(input_ids=PROMPTS[1], sampling_params=sp)["output_ids"] == references[("attn", 1)]
    eng.unload_lora_adapter("x")
    eng.load_lora_adapter("x", adapters["all"])
    out = eng.generate(input_ids=PROMPTS[1], sampling_params=sp)
    assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == references[("all", 1)]
    eng.unload_lora_adapter("x")
    copy = shutil.copytree(adapters["attn"], tmp_path / "attn-copy")
    eng.load_lora_adapter("x", str(copy))
    out = eng.generate(input_ids=PROMPTS[1], sampling_params=sp)
    assert out["meta_info"]["cached_tokens"] == 8 and out["output_ids"] == references[("attn", 1)]


def test_max_loras_per_batch_defers_other_adapters(make_engine, adapters, references):
    eng = make_engine(lora_paths=_paths(adapters), max_loras_per_batch=2)
    seen: list[set] = []
    build = eng.core.runner.build

    def spy(sched):
        seen.append({r.lora for r in sched.reqs} - {None})
        return build(sched)

    eng.core.runner.build = spy
    names = ["attn", None, "all", "mlp8", "attn", None]
    outs = eng.generate(
        input_ids=[PROMPTS[0]] * len(names),
        sampling_params=[{**G, "lora_path": n} if n else G for n in names],
    )
    for n, out in zip(names, outs):
        assert out["output_ids"] == references[(n, 0)], n
    assert max(len(s) for s in seen) == 2  # never three adapters in one step
    assert set().union(*seen) == {"attn", "all", "mlp8"}  # yet every adapter ran


def test_unloading_an_adapter_in_use_is_refused(make_engine, adapters, references):
    """Refused (409) while a request of it is queued or running; allowed once they end, after which
    a request naming it is refused (404) before it holds anything."""
    eng = make_engine(lora_paths=_paths(adapters))
    rid = eng.add_request(PROMPTS[0], {**G, "lora_path": "attn"})
    with pytest.raises(ConflictError) as e:
        eng.unload_lora_adapter("attn")  # queued
    assert e.value.status == 409
    eng.step()
    with pytest.raises(ConflictError):
        eng.unload_lora_adapter("attn")  # running
    eng.run_until_idle()
    assert eng.result(rid)["output_ids"] == references[("attn", 0)]
    eng.unload_lora_adapter("attn")
    with pytest.raises(NotFoundError):
        eng.generate(input_ids=PROMPTS[0], sampling_params={**G, "lora_path": "attn"})
    assert eng.generate(input_ids=PROMPTS[0], sampling_params={**G, "lora_path": "all"})["output_ids"] == (
        references[("all", 0)]
    )


def test_bad_adapters_and_names_are_refused(make_engine, adapters, tmp_path):
    eng = make_engine(enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValidationError, match="rank 8, above --max-lora-rank 4"):
        eng.load_lora_adapter("big", adapters["mlp8"])
    with pytest.raises(ValidationError, match="not a directory"):
        eng.load_lora_adapter("gone", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match=r"lacks adapter_config\.json"):
        eng.load_lora_adapter("empty", str(tmp_path / "empty"))
    bad = shutil.copytree(adapters["attn"], tmp_path / "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValidationError, match="cannot be read"):
        eng.load_lora_adapter("bad", str(bad))
    with pytest.raises(NotFoundError):
        eng.unload_lora_adapter("never")
    with pytest.raises(NotFoundError):
        eng.generate(input_ids=PROMPTS[0], sampling_params={**G, "lora_path": "never"})
    eng.load_lora_adapter("attn", adapters["attn"])
    with pytest.raises(ValidationError, match="loaded already"):
        eng.load_lora_adapter("attn", adapters["all"])
    with pytest.raises(ValidationError, match="LoRA adapters do not work with session turns"):
        sid = eng.open_session()
        eng.generate(input_ids=PROMPTS[0], sampling_params={**G, "lora_path": "attn"},
                     session_params={"id": sid})  # fmt: skip
    eng.close_session(sid)
    plain = make_engine()
    with pytest.raises(ValidationError, match="--enable-lora"):
        plain.load_lora_adapter("attn", adapters["attn"])
    with pytest.raises(NotFoundError):
        plain.generate(input_ids=PROMPTS[0], sampling_params={**G, "lora_path": "attn"})


def test_adapters_over_quantized_base_weights():
    """On an int8 / int4 projection (the kernels' copy of the weights), an adapter's rows get the
    float delta on top of the quantized output and the base rows are untouched, bit for bit."""
    from kvledger.model import lora
    from kvledger.model.linear import Linear

    torch.manual_seed(0)
    w = torch.randn(96, 64)
    x = torch.randn(5, 64).bfloat16()
    for mode in ("int8", "int4"):
        lin = Linear(w.bfloat16(), quantization=mode, dtype=torch.bfloat16)
        base = lin(x).clone()
        layer = lora.LoraLayer(0, [("q_proj", 64), ("k_proj", 32)], 64, lin.device, lin.dtype)
        a, b = torch.randn(4, 64), torch.randn(32, 4)
        layer.weights["z"] = (a, torch.cat([torch.zeros(64, 4), b]))
        lin.lora = layer
        assert torch.equal(lin(x), base)  # no adapter batch active: the base output
        with lora.active(lora.LoraBatch.of(["z", None], [2, 3], "cpu")):
            y = lin(x)
        assert torch.equal(y[2:], base[2:])
        want = base[:2].float() + torch.cat([torch.zeros(2, 64), (x[:2].float() @ a.t()) @ b.t()], dim=1)
        assert torch.equal(y[:2], want.bfloat16())


def test_adapters_serve_on_after_a_weight_update(make_engine, tiny_llama, adapters, references):
    """``/update_weights_from_disk`` builds a new model: the adapters are put on its projections."""
    eng = make_engine(lora_paths=_paths(adapters))
    ok, message, _ = eng.update_weights_from_disk(tiny_llama)
    assert ok, message
    for name in ("attn", "all", None):
        out = eng.generate(input_ids=PROMPTS[2], sampling_params={**G, "lora_path": name} if name else G)
        assert out["output_ids"] == references[(name, 2)], name


def test_pd_transfers_are_namespaced_by_adapter(make_engine, adapters, references):
    """Prefill and decode both serve the adapters: a request of an adapter decodes what its merged
    model answers (the KV prefilled under it); a decode request of another adapter than the one its
    room was prefilled with is refused the KV (the claim's checksum folds the adapter in)."""
    from tests.engine.test_disagg import drive, free_port, room

    port = free_port()
    common = dict(lora_paths=_paths(adapters), disaggregation_bootstrap_port=port)
    pre = make_engine(disaggregation_mode="prefill", disaggregation_bind_host="127.0.0.1", page_size=16, **common)
    dec = make_engine(disaggregation_mode="decode", page_size=4, **common)
    try:
        for i, (pname, dname) in enumerate([("attn", "attn"), ("all", "all"), ("all", "attn")]):
            pre.add_request(PROMPTS[3], {**G, "lora_path": pname}, rid=f"p{i}", disagg=room(port, 200 + i))
            dec.add_request(PROMPTS[3], {**G, "lora_path": dname}, rid=f"d{i}", disagg=room(port, 200 + i))
        res = drive([pre, dec], {id(pre): ["p0", "p1", "p2"], id(dec): ["d0", "d1", "d2"]})
        assert res["d0"]["output_ids"] == references[("attn", 3)]
        assert res["d1"]["output_ids"] == references[("all", 3)]
        fin = res["d2"]["meta_info"]["finish_reason"]
        assert fin["type"] == "abort" and "differs" in fin["message"], fin
    finally:
        for eng in (pre, dec):
            eng.core.disagg_connector.timeout_s = 0.2
            eng.run_until_idle()
            eng.core.disagg_connector.close()


def test_bad_lora_flags_are_refused_before_anything_starts(tmp_path):
    from kvledger.config import EngineConfig

    for paths in ([f"a={tmp_path}/missing"], ["a=" + str(tmp_path), "a=" + str(tmp_path)], ["=x"]):
        with pytest.raises(ValidationError):
            check_settings(EngineConfig.from_flat(lora_paths=paths))
    cfg = EngineConfig.from_flat(lora_paths=[str(tmp_path)], max_loras_per_batch=2)
    check_settings(cfg)
    assert cfg.lora.enable_lora and cfg.lora.named_paths() == {tmp_path.name: str(tmp_path)}
    with pytest.raises(ValidationError):
        check_settings(EngineConfig.from_flat(enable_lora=True, max_lora_rank=0))
    for other in ({"tp_size": 2}, {"enable_torch_compile": True}):  # the table's refusals, with reasons
        with pytest.raises(ValidationError, match="LoRA adapters"):
            check_settings(EngineConfig.from_flat(enable_lora=True, **other))
