"""The compatibility table as configurations to run (issue 30).

``knobs`` turns each start-up feature on; ``covering_array`` gives few configurations that together
put every allowed pair of features on at once, and each feature beside every other one off (pairwise
generation); ``engine_settings`` makes one configuration an engine's settings with the rest drawn at
random (page size, pool, chunk, ...), and ``start`` starts its engine (a PD row: two). The
combination fuzz (tests/fuzz/test_combinations.py), the seeds' scenarios (tests/engine/
test_seed_cases.py) and the long runs (bench/fuzz_combinations.py) all read the table through here, at
run time: a pair that leaves ``compat.REFUSED`` is run by all three with no change here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import torch

from kvledger import Engine, compat
from tests.server_harness import free_port, process_alive

Row = frozenset  # a configuration: the names of the features it turns on

# What a feature needs beside it to run at all (not a table fact: int8 batches quantize the
# activations of a weight-quantized linear, so they come with a quantized mode).
REQUIRES = {"int8_batch": "quantized", "amx": "quantized"}
# Start-up seconds a feature adds on 2 CPU cores with the tiny model (measured): among equally good
# choices the covering array takes the cheaper feature, so the expensive ones sit in fewer rows.
COST = {"compile": 11.0, "tp": 2.0, "pd": 1.0, "cpu_attention": 0.5, "deterministic": 0.5}
# A feature that takes effect only with some others off (overlap scheduling runs synchronously under
# TP and with a KV connector): some row must have it on with all of those off, ("alone", feature).
EFFECTIVE_WITHOUT = {"overlap": frozenset({"tp", "pd", "hicache"})}
COST_OF_A_RUN = 5.0  # a row's workload (the CI's steps), whatever its features
# A request-level feature: on in every configuration whose start-up features allow it (the workload
# always has session turns then).
REQUEST_LEVEL = tuple(f.name for f in compat.FUZZED if f.request_level)


def knobs(draft_model: str) -> dict[str, dict]:
    """Settings that turn each start-up feature on (and nothing else that the table refuses)."""
    return {
        "cuda": {"device": "cuda"},
        "tp": {"tp_size": 2},
        "compile": {"enable_torch_compile": True},
        "draft": {"speculative_algorithm": "standalone", "speculative_draft_model_path": draft_model},
        "ngram": {"speculative_algorithm": "ngram"},
        "pd": {"disaggregation_mode": "PREFILL"},
        "hicache": {"enable_hierarchical_cache": True},
        # Every request sparse, with a budget small enough that long ones select and evict pages.
        "hisparse": {"enable_hisparse": True, "hisparse_min_context": 0, "hisparse_top_k_pages": 2,
                     "hisparse_hot_pages": 5, "hisparse_sink_pages": 1, "hisparse_recent_pages": 2,
                     "page_size": 16},  # (whole pages: at least 8)
        "no_prefix_cache": {"enable_prefix_cache": False},
        "mixed_chunk": {"enable_mixed_chunk": True},
        "cpu_attention": {"attention_backend": "CPU"},
        "torch_attention": {"attention_backend": "torch"},
        "int8_batch": {"enable_int8_batch": True},
        "amx": {"cpu_amx": "on"},
        "quantized": {"quantization": "INT4"},
        "unquantized": {"quantization": "none"},
        "fp32": {"dtype": "fp32"},
        "fp8_kv": {"kv_cache_dtype": "FP8"},
        # Threshold 0: the workload's priorities (0-3) preempt whenever the slots or the pool are full.
        "priority": {"enable_priority_scheduling": True, "priority_scheduling_preemption_threshold": 0},
        "cache_aware_policy": {"schedule_policy": "LPM"},
        "lora": {"enable_lora": True},  # its adapters: ``fuzz_adapters`` (start() adds them)
        "deterministic": {"enable_deterministic_inference": True},
        "overlap": {"disable_overlap_schedule": False},
        # The model's feature: ``start`` serves the row's model, the windowed variant (``row_model``).
        "sliding_window": {},
    }


# Images (issue 52) run on the tiny LLaVA, one row per start-up feature the table allows beside them
# (``image_rows``); these serve another model or its own adapters, so they have no image row.
IMAGE_ROWS_WITHOUT = {
    "sliding_window": "a windowed variant of the text model",
    "lora": "the chat model's adapters",
    "pd": "a prefill and a decode engine (tests/engine/test_vision.py runs images through PD)",
}


def image_rows() -> list[Row]:
    """The plain row and each runnable start-up feature (with what it requires) that the table
    allows with ``images``: a pair lifted from ``compat.REFUSED`` gets its row here at once."""
    rows = [frozenset()]
    for f in runnable_here():
        if f in IMAGE_ROWS_WITHOUT or compat.BY_NAME[f].request_level:
            continue
        row = frozenset(_closure({f}))
        if compatible(row | {"images"}):
            rows.append(row)
    return rows


def cuda_here() -> bool:
    return torch.cuda.is_available()


def runnable_here() -> list[str]:
    """The features this machine can run (the table's order): all but CUDA without a CUDA device."""
    return [f.name for f in compat.FUZZED if f.name != "cuda" or cuda_here()]


def compatible(row: Iterable[str]) -> bool:
    """No two features of ``row`` refused or exclusive."""
    return all(
        compat.refusal(a, b) is None and frozenset({a, b}) not in compat.EXCLUSIVE
        for a, b in combinations(sorted(set(row)), 2)
    )


def pairs(row: Iterable[str]) -> set[frozenset[str]]:
    return {frozenset(p) for p in combinations(sorted(set(row)), 2)}


def allowed_pairs(features: Sequence[str] | None = None) -> set[frozenset[str]]:
    """The table's allowed pairs, among ``features`` (default: all)."""
    keep = set(features) if features is not None else {f.name for f in compat.FUZZED}
    return {frozenset(p) for p in compat.allowed_pairs() if set(p) <= keep}


def _closure(row: set[str]) -> set[str]:
    row = set(row)
    for f, needs in REQUIRES.items():
        if f in row:
            row.add(needs)
    return row


def row_cost(row: Row) -> float:
    """Seconds a row's engines take to start, plus its workload's (PD starts two engines)."""
    return (2 if "pd" in row else 1) * sum(COST.get(f, 0) for f in row) + COST_OF_A_RUN


def covering_array(features: Sequence[str] | None = None, tries: int = 200) -> list[Row]:
    """Configurations that together cover every allowed pair of ``features`` both on, and every
    feature on with each other one off (a feature with the prefix cache on, without mixed chunks, ...),
    none with a refused or exclusive pair. Greedy, as AETG: each row starts from something still
    uncovered and takes the feature that covers most of what is left, less ``price`` x its start-up
    cost, until none adds; of ``tries`` runs with ties broken at random (seeded: one table gives one
    array) the cheapest wins. Request-level features join every row that allows them."""
    features = list(features if features is not None else runnable_here())
    key = (tuple(features), tries, tuple(sorted(allowed_pairs(features), key=sorted)))
    if key not in _ARRAYS:  # one per table: the test modules and the bench ask for the same one
        _ARRAYS[key] = _cheapest(features, tries)
    return list(_ARRAYS[key])


_ARRAYS: dict[tuple, list[Row]] = {}


def _cheapest(features: list[str], tries: int) -> list[Row]:
    best: list[Row] | None = None
    for t in range(tries):
        rng = random.Random(t)
        rows = _greedy(features, rng, price=rng.choice([0.0, 0.2, 0.5, 1.0]))
        if best is None or sum(map(row_cost, rows)) < sum(map(row_cost, best)):
            best = rows
    assert best is not None
    return sorted(best, key=lambda r: (-row_cost(r), row_id(r)))


def _targets(features: list[str]) -> set[tuple]:
    """What a covering array must cover: ("on", a, b) both on (an allowed pair), ("off", a, b) a on
    with b off (b a start-up feature that ``a`` does not bring with it)."""
    on = {("on", *sorted(p)) for p in allowed_pairs(features)}
    off = {
        ("off", a, b)
        for a in features
        for b in features
        if a != b and b not in REQUEST_LEVEL and b not in _closure({a}) and compatible(_closure({a}))
    }
    alone = {("alone", f) for f in features if f in EFFECTIVE_WITHOUT}
    return on | off | alone


def covers(row: Iterable[str]) -> set[tuple]:
    row = set(row)
    return (
        {("on", *sorted(p)) for p in pairs(row)}
        | {("off", a, b) for a in row for b in runnable_here() if b not in row}
        | {("alone", f) for f in row if f in EFFECTIVE_WITHOUT and not row & EFFECTIVE_WITHOUT[f]}
    )


def _greedy(features: list[str], rng: random.Random, price: float) -> list[Row]:
    """One greedy array."""
    todo = _targets(features)
    rows: list[Row] = []
    while todo:
        # Start from what the most expensive feature left needs: its row then gathers the rest of it.
        first = max(
            sorted(todo), key=lambda t: (COST.get(t[1], 0) + COST.get(t[-1], 0) * (t[0] == "on"), rng.random())
        )
        row = _closure(set(first[1:]) if first[0] == "on" else {first[1]})
        banned = {"off": {first[-1]}, "alone": EFFECTIVE_WITHOUT.get(first[1], set())}.get(first[0], set())
        assert compatible(row), f"{first} needs {sorted(row)}, which the table refuses"
        while True:
            best, best_key = None, None
            have = len(covers(row) & todo)
            for f in features:
                if f in row or f in REQUEST_LEVEL:
                    continue
                cand = _closure(row | {f})
                if cand & banned or not compatible(cand):
                    continue
                added = sum(COST.get(g, 0) for g in cand - row)
                gain = len(covers(cand) & todo) - have - price * added
                if gain <= 0:
                    continue
                key = (gain, -added, rng.random())
                if best_key is None or key > best_key:
                    best, best_key = cand, key
            if best is None:
                break
            row = best
        for f in REQUEST_LEVEL:
            if f in features and compatible(row | {f}):
                row.add(f)
        todo -= covers(row)
        rows.append(frozenset(row))
    return rows


def not_run_here(rows: Sequence[Row] | None = None) -> list[tuple[str, str]]:
    """Allowed pairs that no row covers on this machine (the CUDA ones without a CUDA device)."""
    rows = covering_array() if rows is None else rows
    covered = set().union(set(), *(pairs(r) for r in rows))
    return sorted(tuple(sorted(p)) for p in allowed_pairs() - covered)


def row_id(row: Row) -> str:
    """A configuration's name: its start-up features in the table's order (``plain`` for none)."""
    names = [f.name for f in compat.FEATURES if f.name in row and not f.request_level]
    return "+".join(names) or "plain"


def exact(row: Row) -> bool:
    """Greedy and seeded outputs of this configuration are token-exact to the fp32 plain engine's on
    the model the caller gave. HiSparse's knob reads 5 pages of a sequence's many (its point:
    selection and LRU eviction under every other feature), which changes outputs; with every page
    selected it is exact, which tests/engine/test_hisparse.py checks. A sliding-window row serves
    another model (``row_model``): exact to that model's plain engine instead (``exact_to_row_model``)."""
    return exact_to_row_model(row) and "sliding_window" not in row


def exact_to_row_model(row: Row) -> bool:
    """Token-exact to the fp32 plain engine on the row's own model (``row_model``): not where the KV
    pool rounds to float8."""
    return "fp32" in row and "cuda" not in row and "hisparse" not in row and "fp8_kv" not in row


WINDOW = 24
"""The windowed variant's window: shorter than most of the workloads' sequences, and no multiple of
the page sizes drawn (16), so releases stop mid-page."""
_WINDOWED: dict[str, tuple[str, object]] = {}


def row_model(row: Row, model: str, loaded):
    """The model ``row`` serves and its loaded copy: ``model`` (``loaded``), or for a sliding-window
    row its windowed variant: the same weights and tokenizer as a Mistral whose every layer attends
    within ``WINDOW`` tokens (a Llama checkpoint is one, with ``sliding_window`` set)."""
    if "sliding_window" not in row:
        return model, loaded
    if model not in _WINDOWED:
        import json
        import shutil
        import tempfile

        from kvledger.model import load_model

        path = tempfile.mkdtemp(prefix="kvledger-windowed-")
        shutil.copytree(model, path, dirs_exist_ok=True)
        with open(f"{path}/config.json") as f:
            cfg = json.load(f)
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=WINDOW)
        with open(f"{path}/config.json", "w") as f:
            json.dump(cfg, f)
        _WINDOWED[model] = (path, load_model(path))
    return _WINDOWED[model]


def _pick(rng: random.Random | None, choices: list):
    return choices[0] if rng is None else rng.choice(choices)


def engine_settings(row: Row, draft_model: str, tmp_dir: str, rng: random.Random | None = None) -> dict:
    """One engine's settings for ``row`` (flat names): the features' knobs, strict books, and the rest
    drawn from ``rng`` so runs differ (a pool small enough to retract, short chunks, small caps; the
    first of each choice without ``rng``). A PD row's roles are ``pd_settings``'."""
    k = knobs(draft_model)
    s: dict = dict(
        dtype="auto",
        page_size=_pick(rng, [4, 1, 16]),
        max_total_tokens=_pick(rng, [320, 256, 448]),
        chunked_prefill_size=_pick(rng, [32, 16, 64]),
        max_running_requests=_pick(rng, [8, 4, 6]),
        max_queued_requests=24,
        max_sessions=4,
        strict_memory=True,
        audit_interval_s=_pick(rng, [0.2, 0]),
        seed=rng.randrange(1000) if rng else 0,
    )
    for f in row:
        if f in k and f != "pd":
            s.update(k[f])
    if "quantized" in row:
        s["quantization"] = _pick(rng, ["int4", "int8"])
    if "priority" in row:
        s["schedule_low_priority_values_first"] = _pick(rng, [False, True])
    if "cache_aware_policy" in row:
        s["schedule_policy"] = _pick(rng, ["lpm", "dfs-weight"])
    if "lora" in row:
        s["max_loras_per_batch"] = _pick(rng, [1, 2, 8])
    if "draft" in row or "ngram" in row:
        s["speculative_num_draft_tokens"] = rng.randint(2, 5) if rng else 4
    if "hicache" in row:
        s.update(hicache_ratio=_pick(rng, [4.0, 1.5]), hicache_load_back_threshold=_pick(rng, [0, 8]),
                 hicache_write_policy=_pick(rng, ["write_through", "write_through_selective", "write_back"]))  # fmt: skip
        if rng is not None and rng.random() < 0.5:
            s.update(
                hicache_storage_backend="file",
                hicache_storage_dir=f"{tmp_dir}/l3",
                hicache_prefetch_threshold=8,
            )
    if "hisparse" in row:
        s["page_size"] = _pick(rng, [8, 16])  # HiSparse selects whole pages
        s["hisparse_host_ratio"] = _pick(rng, [4.0, 2.0])
    s["max_total_tokens"] -= s["max_total_tokens"] % s["page_size"]
    return s


def pd_settings(base: dict, port: int, rng: random.Random | None = None) -> tuple[dict, dict]:
    """The prefill and the decode engine of a PD row (decode's page size drawn apart: the transfer is
    token-granular). An abort on either side tells the other, so no request waits out a timeout: one
    that does (60 s) is a failure of the fuzz."""
    common = dict(disaggregation_bootstrap_port=port, disaggregation_bootstrap_timeout_s=60.0,
                  disaggregation_waiting_timeout_s=60.0)  # fmt: skip
    pre = {**base, **common, "disaggregation_mode": "prefill", "disaggregation_bind_host": "127.0.0.1"}
    dec = {**base, **common, "disaggregation_mode": "decode", "page_size": _pick(rng, [16, 1, 4])}
    if base.get("enable_hisparse"):
        dec["page_size"] = base["page_size"]  # HiSparse selects whole pages
    if base.get("tp_size", 1) > 1:
        # One process holds one TP group (torch.distributed's default group): one side keeps its
        # ranks, the other runs whole, so the transfer splits or joins heads (tests/integration/
        # test_pd_tp_router.py runs TP on both sides, as two servers).
        (pre, dec)[_pick(rng, [1, 0])]["tp_size"] = 1
    return pre, dec


_ADAPTERS: dict[str, dict[str, str]] = {}


def fuzz_adapters(model: str) -> dict[str, str]:
    """Two LoRA adapters of ``model`` as peft makes them (``B`` zero: no change to the output), so a
    workload's adapter requests must answer what the plain reference answers while they take every
    adapter path: their rows' deltas, the cache namespaced by adapter, ``--max-loras-per-batch``.
    (What the adapters compute is checked against peft in tests/engine/test_lora.py.)"""
    if model not in _ADAPTERS:
        import tempfile

        from peft import LoraConfig, get_peft_model

        from tests.helpers import hf_model

        d = tempfile.mkdtemp(prefix="kvledger-fuzz-lora-")
        out = {}
        for i, targets in enumerate((["q_proj", "v_proj"], ["o_proj", "gate_proj", "down_proj"])):
            torch.manual_seed(i)
            m = get_peft_model(hf_model(model), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
            m.save_pretrained(f"{d}/fz{i}")
            out[f"fz{i}"] = f"{d}/fz{i}"
        _ADAPTERS[model] = out
    return _ADAPTERS[model]


@dataclass
class Started:
    """A configuration's engines: one, or a PD row's prefill and decode (``port``: its bootstrap)."""

    engines: list
    port: int | None = None

    @property
    def pd(self) -> bool:
        return self.port is not None

    def shutdown(self) -> None:
        """Every engine shut down; a TP row's worker processes must be gone."""
        pids = [p for e in self.engines for p in e.core.info.tp_worker_pids]
        for e in self.engines:
            e.shutdown(drain_timeout_s=10)  # after a violation the work may never end: do not wait long
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in pids):
            assert time.monotonic() < deadline, "a TP worker outlived its engine"
            time.sleep(0.05)


def start(row: Row, model: str, loaded, draft_model: str, tmp_dir: str, rng: random.Random | None = None,
          **overrides) -> Started:  # fmt: skip
    """Start ``row``'s engine(s) on ``model`` (a path: TP workers load it; ``loaded``: rank 0's copy),
    or on its windowed variant for a sliding-window row (``row_model``)."""
    model, loaded = row_model(row, model, loaded)
    s = {**engine_settings(row, draft_model, tmp_dir, rng), **overrides}
    if "lora" in row:
        s["lora_paths"] = [f"{name}={path}" for name, path in fuzz_adapters(model).items()]
    if "pd" not in row:
        return Started([Engine(model=model, loaded_model=loaded, **s)])
    port = free_port()
    pre_s, dec_s = pd_settings(s, port, rng)
    engines = [Engine(model=model, loaded_model=loaded, **pre_s)]
    try:
        engines.append(Engine(model=model, loaded_model=loaded, **dec_s))
    except BaseException:
        engines[0].shutdown()
        raise
    return Started(engines, port)
