"""The settings model (issue 30): sections with their own checks, enum-like values normalised once,
one compatibility table that every start-up check and the README's matrix come from."""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

import pytest

from kvledger import Engine, compat
from kvledger.cli import add_engine_args
from kvledger.config import EngineConfig
from kvledger.errors import ValidationError
from kvledger.launch import validate
from kvledger.launch.validate import check_settings
from tests import combos

README = Path(__file__).resolve().parents[2] / "README.md"


def knobs(tmp_path: Path) -> dict[str, dict]:
    """Each start-up feature's settings (``tests/combos.py``), the draft model an existing directory."""
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    return combos.knobs(str(draft))


def test_every_pair_is_refused_exactly_where_the_table_says(tmp_path, monkeypatch):
    """For every pair of start-up features: a configuration with both either passes every check or is
    refused with one error naming both and the table's reason — never refused by another rule."""
    monkeypatch.setattr(validate, "resolve_device", lambda name: "cuda" if "cuda" in name else "cpu")
    k = knobs(tmp_path)
    assert set(k) == {f.name for f in compat.FUZZED if not f.request_level}  # a knob per fuzzed feature
    for a, b in itertools.combinations(k, 2):
        pair = frozenset({a, b})
        if pair in compat.EXCLUSIVE:
            continue
        model = [f for f in (a, b) if compat.BY_NAME[f].model_level]
        if model:  # the model's feature: refused once the model is loaded, by the same table
            _model_pair_is_refused_where_the_table_says(k, model[0], b if model[0] == a else a)
            continue
        cfg = EngineConfig.from_flat(**{**k[a], **k[b]})
        assert set(compat.active_features(cfg, cfg.model.device if "cuda" in (a, b) else "cpu")) >= {a, b}
        refusal = compat.refusal(a, b)
        if refusal is None:
            check_settings(cfg)
            continue
        with pytest.raises(ValidationError) as e:
            check_settings(cfg)
        msg = str(e.value)
        assert compat.BY_NAME[a].title in msg and compat.BY_NAME[b].title in msg and refusal.reason in msg, msg


def _model_pair_is_refused_where_the_table_says(k: dict, model_feature: str, other: str) -> None:
    cfg = EngineConfig.from_flat(**k[other])
    device = "cuda" if other == "cuda" else "cpu"
    assert other in compat.active_features(cfg, device)
    refusal = compat.refusal(model_feature, other)
    if refusal is None:
        compat.check_model(cfg, device, [model_feature])
        return
    with pytest.raises(ValidationError) as e:
        compat.check_model(cfg, device, [model_feature])
    msg = str(e.value)
    assert compat.BY_NAME[model_feature].title in msg and compat.BY_NAME[other].title in msg, msg
    assert refusal.reason in msg and e.value.param == compat.BY_NAME[other].param, msg


def test_enum_like_settings_are_normalised_where_they_are_parsed(tmp_path):
    """``standalone`` and ``STANDALONE`` are one algorithm: before, only upper case met the refusals."""
    k = knobs(tmp_path)
    cfg = EngineConfig.from_flat(**k["draft"], disaggregation_mode="Decode")
    assert cfg.spec.speculative_algorithm == "STANDALONE" and cfg.disagg.disaggregation_mode == "decode"
    assert set(compat.active_features(cfg, "cpu")) >= {"draft", "pd"}  # the predicates see them
    cfg = EngineConfig.from_flat(**k["quantized"], dtype="FP32")
    assert cfg.model.explicit_quantization == "int4" and cfg.model.dtype == "float32"
    with pytest.raises(ValidationError, match=r"int8/int4 weights .* does not work with float32"):
        check_settings(cfg)
    with pytest.raises(ValidationError, match="does not work with"):
        Engine(quantization="Int8", dtype="fp32")  # the offline API goes through the same check
    cfg = EngineConfig.from_flat(dtype="BF16", quantization="None", attention_backend=" Torch ",
                                 disaggregation_mode="null", hicache_write_policy="WRITE_BACK")  # fmt: skip
    assert (cfg.model.dtype, cfg.model.quantization, cfg.kernels.attention_backend) == ("bfloat16", None, "torch")
    assert cfg.disagg.disaggregation_mode is None and cfg.hicache.hicache_write_policy == "write_back"
    assert EngineConfig.from_flat(schedule_policy=" LPM ").scheduler.schedule_policy == "lpm"
    for bad, param in (
        ({"speculative_algorithm": "eagle"}, "speculative_algorithm"),
        ({"dtype": "float16"}, "dtype"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"page_size": 0}, "page_size"),
        ({"tp_size": 3, "nnodes": 2}, "tp_size"),
        ({"disaggregation_mode": "both"}, "disaggregation_mode"),
        ({"enable_hierarchical_cache": True, "hicache_write_policy": "sometimes"}, "hicache_write_policy"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"request_timeout_s": float("nan")}, "request_timeout_s"),
        ({"request_timeout_s": float("inf")}, "request_timeout_s"),
        ({"max_queued_prefill_tokens": 0}, "max_queued_prefill_tokens"),
        ({"schedule_policy": "lof"}, "schedule_policy"),
        ({"priority_scheduling_preemption_threshold": -1}, "priority_scheduling_preemption_threshold"),
        ({"schedule_policy": "lpm", "enable_prefix_cache": False}, "schedule_policy"),
    ):
        with pytest.raises(ValidationError) as e:
            check_settings(EngineConfig.from_flat(**bad))
        assert e.value.param == param, (bad, e.value.param)


def test_the_flat_view_round_trips_and_every_setting_is_a_flag():
    cfg = EngineConfig.from_flat(page_size=16, tp_size=2, speculative_algorithm="ngram", hicache_ratio=3.0)
    assert EngineConfig.from_flat(**cfg.flat()) == cfg
    assert cfg.cache.page_size == 16 and cfg.parallel.tp_size == 2 and cfg.hicache.hicache_ratio == 3.0
    assert cfg.replace(page_size=4).cache.page_size == 4 and cfg.cache.page_size == 16
    with pytest.raises(TypeError, match=r"unknown engine option.*pagesize"):
        EngineConfig.from_flat(pagesize=16)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    dests = {a.dest for a in p._actions}
    assert set(EngineConfig.section_of()) <= dests, set(EngineConfig.section_of()) - dests
    defaults = vars(p.parse_args([]))
    flat = EngineConfig().flat()
    for name, value in flat.items():  # the flags' defaults are the settings' own
        if name not in ("page_size", "quantization"):  # page size: derived; quantization: "none" spelled out
            assert defaults[name] == value, name


def test_the_readme_matrix_is_the_table():
    text = README.read_text()
    m = re.search(r"<!-- compat-matrix:[^\n]*-->\n(.*?)\n<!-- /compat-matrix -->", text, re.S)
    assert m, "README.md lacks the compat-matrix markers"
    assert m.group(1).strip() == compat.markdown_matrix().strip(), "regenerate: python -m kvledger.compat --write"


def test_a_request_level_refusal_names_the_tables_reason(monkeypatch):
    """A request-level feature is refused with the table's reason where the engine has a feature it
    does not combine with (none is left today: PD x session turns works since issue 35)."""
    compat.check_request(EngineConfig.from_flat(disaggregation_mode="decode"), "sessions")  # works
    pair = frozenset({"pd", "sessions"})
    monkeypatch.setitem(compat.REFUSED, pair, compat.Refusal(compat.NOT_YET, "a reason"))
    cfg = EngineConfig.from_flat(disaggregation_mode="decode")
    with pytest.raises(ValidationError, match="session turns do not work with PD disaggregation") as e:
        compat.check_request(cfg, "sessions")
    assert "a reason" in str(e.value) and e.value.param == "session_params"
    compat.check_request(EngineConfig(), "sessions")  # no PD: fine


# The features outside the fuzz's matrix that a setting turns on: the settings that turn each on.
OTHER_KNOBS = {
    "small_pages": {"page_size": 4},
    "multinode": {"tp_size": 2, "nnodes": 2, "dist_init_addr": "127.0.0.1:29999"},
}


def _ask(feature: str, cfg: EngineConfig, device: str, others: tuple[str, ...] = ()) -> None:
    """Ask the table about ``feature`` the way the code that meets it does."""
    f = compat.BY_NAME[feature]
    if f.request_level:
        compat.check_request(cfg.replace(device=device), feature, others)
    elif f.model_level:
        compat.check_model(cfg, device, [feature])
    elif feature in OTHER_KNOBS:
        check_settings(cfg)
    else:  # the launcher's (--dp-size) or the caller's (a KV connector)
        compat.check_feature(cfg, device, feature)


def test_every_other_row_is_refused_where_it_meets_and_nowhere_else(tmp_path, monkeypatch):
    """The features outside the fuzz's matrix (request kinds, the launcher's, a caller's, a model's
    property, two settings' values): each against every start-up feature, refused exactly where the
    table has a row (with its reason and its code), and each request-level pair as the engine asks it."""
    monkeypatch.setattr(validate, "resolve_device", lambda name: "cuda" if "cuda" in name else "cpu")
    monkeypatch.setenv("KVLEDGER_DIST_AUTH_KEY", "k" * 32)
    k = knobs(tmp_path)
    others = [f for f in compat.FEATURES if not f.fuzzed]
    assert set(compat.OTHER_REFUSALS) <= set(compat.REFUSED) and others
    # Each has a row, but image inputs: every pair of theirs is served now (issue 52: TP, pooling).
    served_everywhere = {"images"}
    assert all(any(f.name in p for p in compat.OTHER_REFUSALS) for f in others if f.name not in served_everywhere)
    assert not any(n in p for n in served_everywhere for p in compat.REFUSED)
    for x in others:
        for y, knob in k.items():
            if compat.BY_NAME[y].model_level or (y in ("tp",) and x.name == "multinode"):
                continue
            if x.name in OTHER_KNOBS and compat.refusal(x.name, y) is None:
                continue  # a setting's value against the rest: the fuzz's pairs' business (tp's rows, ...)
            cfg = EngineConfig.from_flat(**{**knob, **OTHER_KNOBS.get(x.name, {})})
            device = "cuda" if y == "cuda" else "cpu"
            row = compat.refusal(x.name, y)
            if row is None:
                _ask(x.name, cfg, device)
                continue
            with pytest.raises(ValidationError) as e:
                _ask(x.name, cfg, device)
            msg = str(e.value)
            assert x.title in msg and compat.BY_NAME[y].title in msg and row.reason in msg, msg
            assert e.value.code == (x.code or compat.BY_NAME[y].code), msg
        if x.name in OTHER_KNOBS:  # the setting alone starts
            check_settings(EngineConfig.from_flat(**OTHER_KNOBS[x.name]))
    # Two request-level features: a session turn that is an embedding, or under an adapter.
    for a, b in (("sessions", "pooling"), ("adapter", "sessions"), ("prompt_logprobs", "sessions"),
                 ("sessions", "several_prompts")):  # fmt: skip
        with pytest.raises(ValidationError, match=re.escape(compat.refusal(a, b).reason)) as e:
            compat.check_request(EngineConfig(), a, [b])
        assert e.value.param == compat.BY_NAME[a].param
    compat.check_request(EngineConfig(), "sessions")  # either alone: fine
    compat.check_request(EngineConfig.from_flat(enable_lora=True), "adapter")


def test_the_launchers_refusals_come_from_the_table(monkeypatch, capsys):
    """``kvledger serve --dp-size 2`` with PD or several nodes: one line, exit 2, the row's reason
    (refused before any replica starts)."""
    from kvledger import cli

    monkeypatch.setenv("KVLEDGER_DIST_AUTH_KEY", "k" * 32)
    for flags, other in (
        (["--disaggregation-mode", "decode"], "pd"),
        (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:29999"], "multinode"),
    ):
        assert cli.main(["serve", "--dp-size", "2", *flags]) == 2
        err = capsys.readouterr().err
        assert compat.refusal("dp", other).reason in err and "data-parallel replicas" in err, err


def test_a_callers_connector_with_the_hierarchical_cache_is_refused_by_the_table(tiny_loaded):
    """An engine built with a KV connector of the caller's and ``--enable-hierarchical-cache``: refused
    at construction with the row's reason (the cache is a connector itself); without the cache it starts."""
    from kvledger.connector import NoOpConnector

    with pytest.raises(ValidationError, match=re.escape(compat.refusal("connector", "hicache").reason)):
        Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=512, enable_hierarchical_cache=True,
               kv_connector=NoOpConnector())  # fmt: skip
    eng = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=512, kv_connector=NoOpConnector())
    eng.shutdown()


def test_session_turn_refusals_come_from_the_table(make_engine):
    """An embedding request, prompt logprobs, several prompts sent as a session turn: each refused before
    it holds anything, with its row's reason (a turn under a LoRA adapter: tests/engine/test_lora.py);
    the session then takes a plain turn, and the engine is audited clean at teardown."""
    from kvledger.common.pooling import PoolingParams

    eng = make_engine()
    sid = eng.open_session()
    with pytest.raises(ValidationError, match=re.escape(compat.refusal("sessions", "pooling").reason)) as e:
        eng.add_request([5, 6, 7], session_params={"id": sid}, pooling=PoolingParams(embed="last"))
    assert e.value.param == "session_params"
    # Prompt logprobs on a turn, and several prompts as one turn: the rows' reasons, nothing held.
    with pytest.raises(ValidationError, match=re.escape(compat.refusal("prompt_logprobs", "sessions").reason)) as e:
        eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "logprob_start_len": 0},
                     session_params={"id": sid})  # fmt: skip
    assert e.value.param == "logprob_start_len"
    with pytest.raises(ValidationError, match=re.escape(compat.refusal("sessions", "several_prompts").reason)) as e:
        eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 2}, session_params={"id": sid})
    assert e.value.param == "session_params"
    out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, session_params={"id": sid})
    assert len(out["output_ids"]) == 2  # a plain turn still runs
    eng.close_session(sid)
