"""Which features combine: the one compatibility table, and the one place that refuses.

A feature is something a setting turns on (``FEATURES``: its name, the flag, and when a configuration
has it), a property of the model being served (``model_level``: known once it is loaded), what a
request asks (``request_level``: a session turn, an embedding, an adapter, a weight update, ...) or
what the launcher or a caller adds (``--dp-size``, a KV connector). ``REFUSED`` lists every pair that
does not work, with the reason a user is told; every other pair of features works. A refusal is either
*not yet* (the pair has a meaning; the reason says what stands in the way) or *no meaning* (one
feature contradicts the other). ``refuse`` writes every refusal's error; code elsewhere asks the table
(``check_combinations`` at start, the CLI's one line and exit 2; ``check_model`` once the model is
loaded; ``check_feature``; ``check_request`` when a request arrives;
``refusal_error`` where no configuration is at hand) and raises what it answers, never a refusal of
its own. The ``fuzzed`` features are the ones the combination fuzz (tests/fuzz/test_combinations.py)
runs pair by pair; the others' rows (``OTHER_REFUSALS``) are proven one by one by
tests/unit/test_settings.py. The README's matrix is ``markdown_matrix()`` (``python -m kvledger.compat
--write`` regenerates it; a test keeps them equal).

Adding a feature: one ``Feature`` row, its refusals here with their reasons, and the fuzz's knob for
it (``knobs`` in tests/combos.py, which makes the table's configurations for the fuzz).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

from .config import EngineConfig, write_generated
from .errors import KVLedgerError, ValidationError


@dataclass(frozen=True)
class Feature:
    name: str
    title: str  # how errors and the README's matrix name it
    flag: str  # the flag that turns it on
    param: str  # the setting behind the flag (the ``param`` of a refusal; "" for none)
    active: Callable[[EngineConfig, str], bool]  # (settings, resolved device) -> on?
    request_level: bool = False  # on per request (never at start): checked when a request asks for it
    model_level: bool = False  # on by the model (never by a setting): checked once it is loaded
    # Run by the combination fuzz (tests/fuzz/test_combinations.py) and shown in the matrix; the rest
    # (a request's kind, a launcher's or a caller's choice, a model's property without a fuzz model)
    # are refused where they meet by the same rows, each proven by tests/unit/test_settings.py.
    fuzzed: bool = True
    code: str | None = None  # the error code of a refusal of this feature (None: the default)


FEATURES: tuple[Feature, ...] = (
    Feature("cuda", "CUDA device", "--device cuda", "device", lambda c, d: d.startswith("cuda")),
    Feature("tp", "tensor parallel", "--tp-size N", "tp_size", lambda c, d: c.parallel.tp_size > 1),
    Feature("compile", "torch.compile", "--enable-torch-compile", "enable_torch_compile",
            lambda c, d: c.kernels.enable_torch_compile),
    Feature("draft", "draft model", "--speculative-algorithm STANDALONE", "speculative_algorithm",
            lambda c, d: c.spec.draft_model),
    Feature("ngram", "NGRAM drafts", "--speculative-algorithm NGRAM", "speculative_algorithm",
            lambda c, d: c.spec.speculative_algorithm == "NGRAM"),
    Feature("pd", "PD disaggregation", "--disaggregation-mode prefill/decode", "disaggregation_mode",
            lambda c, d: c.disagg.enabled),
    Feature("hicache", "hierarchical cache", "--enable-hierarchical-cache", "enable_hierarchical_cache",
            lambda c, d: c.hicache.enable_hierarchical_cache),
    Feature("hisparse", "HiSparse", "--enable-hisparse", "enable_hisparse",
            lambda c, d: c.hisparse.enable_hisparse),
    Feature("no_prefix_cache", "prefix cache off", "--disable-prefix-cache", "enable_prefix_cache",
            lambda c, d: not c.cache.enable_prefix_cache),
    Feature("mixed_chunk", "mixed chunks", "--enable-mixed-chunk", "enable_mixed_chunk",
            lambda c, d: c.scheduler.enable_mixed_chunk),
    Feature("cpu_attention", "cpu attention backend", "--attention-backend cpu", "attention_backend",
            lambda c, d: c.kernels.attention_backend == "cpu"),
    Feature("torch_attention", "torch attention backend", "--attention-backend torch", "attention_backend",
            lambda c, d: c.kernels.attention_backend == "torch"),
    Feature("int8_batch", "int8 batches", "--enable-int8-batch", "enable_int8_batch",
            lambda c, d: c.kernels.enable_int8_batch),
    Feature("amx", "AMX paths", "--cpu-amx on", "cpu_amx", lambda c, d: c.kernels.cpu_amx == "on"),
    Feature("quantized", "int8/int4 weights", "--quantization int8/int4", "quantization",
            lambda c, d: c.model.explicit_quantization is not None),
    Feature("unquantized", "unquantized weights", "--quantization none", "quantization",
            lambda c, d: c.model.quantization is None),
    Feature("fp32", "float32", "--dtype float32", "dtype", lambda c, d: c.model.dtype == "float32"),
    Feature("fp8_kv", "float8 KV cache", "--kv-cache-dtype fp8_e4m3", "kv_cache_dtype",
            lambda c, d: c.cache.kv_cache_dtype == "fp8_e4m3"),
    Feature("priority", "priority scheduling", "--enable-priority-scheduling", "enable_priority_scheduling",
            lambda c, d: c.scheduler.enable_priority_scheduling),
    Feature("cache_aware_policy", "cache-aware queue order", "--schedule-policy lpm/dfs-weight",
            "schedule_policy", lambda c, d: c.scheduler.cache_aware_policy),
    Feature("lora", "LoRA adapters", "--enable-lora / --lora-paths", "enable_lora",
            lambda c, d: c.lora.enable_lora),
    Feature("deterministic", "deterministic inference", "--enable-deterministic-inference",
            "enable_deterministic_inference", lambda c, d: c.kernels.enable_deterministic_inference),
    # On: it overlaps where it can; under TP and with PD or the hierarchical cache every step is
    # synchronous (engine/core.overlap_schedule), so it combines with everything.
    Feature("overlap", "overlap schedule", "--enable-overlap-schedule", "disable_overlap_schedule",
            lambda c, d: c.scheduler.overlap_wanted(d)),
    Feature("sessions", "session turns", "session_params.id", "session_params", lambda c, d: False,
            request_level=True),
    # A model whose every layer attends within a window (Mistral's sliding_window, Phi-3, ...): the pages
    # that leave the window are given back while requests run (memory/window.py).
    Feature("sliding_window", "sliding-window release", "a model whose every layer slides", "model",
            lambda c, d: False, model_level=True),
    # -- Not in the fuzz's matrix: refused where they meet, by the rows below (``OTHER_REFUSALS``). ------
    # Some layer of the model slides, soft-caps or has sinks (Gemma, gpt-oss, ...): its attention reads
    # every request's pages through the slot table.
    Feature("special_attention", "sliding-window, soft-capped or sink attention",
            "a model with such a layer", "model", lambda c, d: False, model_level=True, fuzzed=False),
    # A mixture-of-experts model: its layers' MLPs are routed experts, not ``Linear`` projections.
    Feature("routed_experts", "routed experts", "a mixture-of-experts model", "model", lambda c, d: False,
            model_level=True, fuzzed=False),
    # A family whose weights kvledger does not shard (``supports_tp = False``: gpt-oss, OLMo 2).
    Feature("unsharded_family", "a family without tensor-parallel shards", "gpt_oss, olmo2", "model",
            lambda c, d: False, model_level=True, fuzzed=False),
    Feature("small_pages", "pages under 8 tokens", "--page-size 1..7", "page_size",
            lambda c, d: c.cache.page_size < 8, fuzzed=False),
    Feature("multinode", "several nodes", "--nnodes N", "nnodes", lambda c, d: c.parallel.nnodes > 1,
            fuzzed=False),
    # Turned on by the launcher, not by an engine setting: ``check_feature``.
    Feature("dp", "data-parallel replicas", "--dp-size N", "dp_size", lambda c, d: False, fuzzed=False),
    # A KV connector handed to the engine by its caller (``Engine(kv_connector=...)``).
    Feature("connector", "a caller's KV connector", "Engine(kv_connector=...)", "kv_connector",
            lambda c, d: False, fuzzed=False),
    # Request-level, besides session turns: what a request asks of the engine.
    Feature("pooling", "embedding and score requests", "/v1/embeddings, /v1/score, /v1/rerank", "pooling",
            lambda c, d: False, request_level=True, fuzzed=False),
    Feature("adapter", "requests' LoRA adapters", "lora_path", "lora_path", lambda c, d: False,
            request_level=True, fuzzed=False),
    Feature("prompt_logprobs", "prompt logprobs", "logprob_start_len", "logprob_start_len", lambda c, d: False,
            request_level=True, fuzzed=False),
    Feature("several_prompts", "several prompts in one request", "a list of prompts", "session_params",
            lambda c, d: False, request_level=True, fuzzed=False),
    # A request with images (a vision-language model: multimodal/). Not in the chat model's covering
    # array (fuzzed False: another model); the combination fuzz runs it beside every start-up feature
    # this table allows with it, on the tiny LLaVA (tests/combos.py image_rows).
    Feature("images", "image inputs", "image_url / input_image parts, image_data", "image_data",
            lambda c, d: False, request_level=True, fuzzed=False),
    Feature("weight_update", "weight updates", "/update_weights_from_disk", "",
            lambda c, d: False, request_level=True, fuzzed=False, code="unsupported_configuration"),
)  # fmt: skip
BY_NAME = {f.name: f for f in FEATURES}
FUZZED = tuple(f for f in FEATURES if f.fuzzed)

NOT_YET = "not yet"
NO_MEANING = "no meaning"


@dataclass(frozen=True)
class Refusal:
    kind: str  # NOT_YET | NO_MEANING
    reason: str


REFUSED: dict[frozenset[str], Refusal] = {
    # A CUDA device: the CPU-only pieces.
    frozenset({"cuda", "tp"}): Refusal(NOT_YET, "tensor parallel's collectives are CPU shared memory and gloo"),
    frozenset({"cuda", "pd"}): Refusal(NOT_YET, "the KV transfer reads and writes host memory"),
    frozenset({"cuda", "hisparse"}): Refusal(
        NOT_YET, "the page choice and the hot-page copies run on the host, over a host-memory KV pool"
    ),
    frozenset({"tp", "hisparse"}): Refusal(
        NOT_YET, "the host pool and the page choice live in rank 0's process; each rank would keep its heads' share"
    ),
    frozenset({"cuda", "fp8_kv"}): Refusal(
        NOT_YET, "the float8 pool is read by the CPU backends (the C++ decode kernel widens it); the CUDA "
        "decode kernels and graphs take the model's dtype"
    ),
    frozenset({"hisparse", "fp8_kv"}): Refusal(
        NOT_YET, "HiSparse's host pool, page choice and hot-page copies take the model's dtype"
    ),
    frozenset({"cuda", "cpu_attention"}): Refusal(NO_MEANING, "the cpu attention backend is C++ CPU kernels"),
    frozenset({"cuda", "int8_batch"}): Refusal(
        NO_MEANING, "int8 batches are a CPU int8 linear (kvledger's VNNI kernel or oneDNN's)"
    ),
    frozenset({"cuda", "amx"}): Refusal(NO_MEANING, "the AMX paths are oneDNN's and torch's CPU kernels"),
    frozenset({"cuda", "quantized"}): Refusal(
        NOT_YET, "the weight-only int8/int4 kernels are CPU kernels (quantization auto serves a quantized "
        "file's weights in bfloat16 there)"
    ),
    # LoRA adapters: the deltas run in the projections' eager calls, on whole (unsharded) weights.
    frozenset({"lora", "tp"}): Refusal(
        NOT_YET, "adapter weights are not sharded: each rank would need its slice of every A and B"
    ),
    frozenset({"lora", "compile"}): Refusal(
        NOT_YET, "the compiled graph has no LoRA deltas in it (adapter rows would need a graph per adapter set)"
    ),
    # Sliding-window release: a running request's early pages are given back.
    frozenset({"sliding_window", "pd"}): Refusal(
        NOT_YET, "the transfer sends a request's KV page by page after its prefill, and prefill gives back the "
        "pages that leave the window while it computes the prompt (decode would get placeholders)"
    ),
    frozenset({"sliding_window", "hisparse"}): Refusal(
        NOT_YET, "a sparse request's history lives in HiSparse's host pool, while the windowed layers read "
        "each request's pages through the slot table"
    ),
    frozenset({"sliding_window", "draft"}): Refusal(
        NOT_YET, "the draft model's KV lives in the target's pages and it attends to every position: a page "
        "given back out of the target's window takes the draft's KV with it"
    ),
    # Deterministic inference: every call on kernels with one order of sums per row (the C++ CPU kernels).
    frozenset({"deterministic", "cuda"}): Refusal(
        NOT_YET, "its row-invariant kernels are kvledger's C++ CPU kernels; on CUDA the forward runs torch's "
        "GEMMs and SDPA, whose sums depend on the batch"
    ),
    frozenset({"deterministic", "int8_batch"}): Refusal(
        NO_MEANING, "int8 batches change a row's arithmetic with the row count of its forward (from 16 rows on "
        "kvledger's VNNI kernel, 128 on oneDNN's)"
    ),
    frozenset({"deterministic", "amx"}): Refusal(
        NO_MEANING, "the AMX paths take large calls only, in other sums than small ones (--cpu-amx auto is off "
        "under deterministic inference)"
    ),
    frozenset({"deterministic", "compile"}): Refusal(
        NOT_YET, "the compiled graph runs torch's bfloat16 GEMMs, whose sums depend on the rows of a call"
    ),
    frozenset({"deterministic", "torch_attention"}): Refusal(
        NO_MEANING, "it runs on the cpu backend's kernels (the torch backend's SDPA and padded matmuls sum by "
        "the batch's shapes)"
    ),
    frozenset({"deterministic", "lora"}): Refusal(
        NOT_YET, "adapter deltas run torch's matmuls over the rows of each adapter, whose sums depend on them"
    ),
    frozenset({"deterministic", "tp"}): Refusal(
        NOT_YET, "the all-reduce of the ranks' partial sums takes the order its collective picks for the "
        "buffer, not one per row"
    ),
    frozenset({"deterministic", "hisparse"}): Refusal(
        NOT_YET, "HiSparse's page choice and sparse attention have no proof of one order of sums per row (its torch "
        "path scores pages with batched matmuls)"
    ),
    # Settings that contradict each other.
    frozenset({"hicache", "no_prefix_cache"}): Refusal(
        NO_MEANING, "the hierarchical cache is the prefix cache's lower tiers"
    ),
    frozenset({"cache_aware_policy", "no_prefix_cache"}): Refusal(
        NO_MEANING, "lpm and dfs-weight order the queue by what the prefix cache holds"
    ),
    frozenset({"int8_batch", "unquantized"}): Refusal(NO_MEANING, "int8 batches need a quantized mode"),
    frozenset({"int8_batch", "fp32"}): Refusal(NO_MEANING, "int8 batches need a quantized mode, in bfloat16"),
    frozenset({"quantized", "fp32"}): Refusal(NO_MEANING, "the weight-only kernels take bfloat16 activations"),
    frozenset({"amx", "unquantized"}): Refusal(
        NO_MEANING, "unquantized bfloat16 layers run oneDNN's GEMM (on AMX where present) already"
    ),
    frozenset({"amx", "fp32"}): Refusal(NO_MEANING, "the AMX paths are bfloat16 GEMMs of a quantized model's weights"),
}

# Refusals of the features outside the fuzz's matrix (``Feature.fuzzed`` False): request kinds, a
# launcher's or a caller's choice, a model property. The same table (``REFUSED`` holds them too); the
# README lists them under the matrix, and tests/unit/test_settings.py proves each by refusing it.
OTHER_REFUSALS: dict[frozenset[str], Refusal] = {
    frozenset({"special_attention", "hisparse"}): Refusal(
        NOT_YET, "those layers read every request's pages through the slot table, and a sparse request's "
        "history lives in HiSparse's host pool"
    ),
    frozenset({"routed_experts", "lora"}): Refusal(
        NOT_YET, "LoRA puts its deltas on each layer's Linear projections, and routed experts have none"
    ),
    frozenset({"unsharded_family", "tp"}): Refusal(
        NOT_YET, "its layers (sinks, experts or norms over the whole width) have no per-rank shards"
    ),
    frozenset({"small_pages", "hisparse"}): Refusal(
        NO_MEANING, "HiSparse selects whole pages, and a page this small makes every token one (use 16, "
        "Quest's, or more)"
    ),
    frozenset({"dp", "pd"}): Refusal(
        NOT_YET, "--dp-size starts regular replicas behind one router (a PD deployment runs its prefill and "
        "decode servers behind sglang-router itself)"
    ),
    frozenset({"dp", "multinode"}): Refusal(NOT_YET, "--dp-size starts its replicas on this machine"),
    frozenset({"connector", "hicache"}): Refusal(
        NO_MEANING, "the hierarchical cache is a KV connector itself; pass one or the other"
    ),
    frozenset({"pooling", "sessions"}): Refusal(NO_MEANING, "they keep no KV for a next turn"),
    frozenset({"adapter", "sessions"}): Refusal(
        NOT_YET, "a session's KV is not bound to one adapter (a turn under another adapter, or none, would "
        "read KV computed under the first)"
    ),
    frozenset({"prompt_logprobs", "sessions"}): Refusal(
        NOT_YET, "a turn's prompt begins with the KV the session holds, which is not computed again"
    ),
    frozenset({"sessions", "several_prompts"}): Refusal(NO_MEANING, "a session takes one turn at a time"),
    frozenset({"weight_update", "tp"}): Refusal(
        NOT_YET, "every rank would have to load its shard in step; restart the server on the new weights"
    ),
    frozenset({"weight_update", "compile"}): Refusal(
        NOT_YET, "the compiled graph froze the weights loaded at start; restart the server on the new weights"
    ),
    frozenset({"weight_update", "hicache"}): Refusal(
        NOT_YET, "its L2 pages and L3 files are keyed by the model loaded at start; restart the server on the "
        "new weights"
    ),
}
REFUSED.update(OTHER_REFUSALS)

# Pairs that cannot be both on by construction (one setting, two values): neither works nor refused.
EXCLUSIVE: frozenset[frozenset[str]] = frozenset(
    {
        frozenset({"draft", "ngram"}),
        frozenset({"quantized", "unquantized"}),
        frozenset({"cpu_attention", "torch_attention"}),
    }
)

if not all(len(p) == 2 and p <= set(BY_NAME) for p in [*REFUSED, *EXCLUSIVE]):
    raise TypeError("the compatibility table names a pair wrongly")


def refusal(a: str, b: str) -> Refusal | None:
    """Why features ``a`` and ``b`` do not combine; None when they do."""
    return REFUSED.get(frozenset({a, b}))


def allowed_pairs() -> list[tuple[str, str]]:
    """Every pair of fuzzed features that works (what the combination fuzz must cover)."""
    return [
        (a.name, b.name)
        for a, b in combinations(FUZZED, 2)
        if frozenset({a.name, b.name}) not in REFUSED and frozenset({a.name, b.name}) not in EXCLUSIVE
    ]


def active_features(cfg: EngineConfig, device: str) -> list[str]:
    return [f.name for f in FEATURES if not f.request_level and f.active(cfg, device)]


def refuse(
    a: str, b: str, *, param: str | None = None, detail: str = "", error: type[KVLedgerError] = ValidationError
) -> KVLedgerError | None:
    """The error of the row of ``a`` x ``b`` (None: they combine): the one place a refusal's message
    is written. It names ``a`` first (with ``detail``, e.g. the model's architecture), then ``b`` and
    the row's reason; ``param`` defaults to ``b``'s, the code to the first feature's that has one;
    ``error``: the class (a model that cannot be served is a ``ModelLoadError``)."""
    r = refusal(a, b)
    if r is None:
        return None
    fa, fb = BY_NAME[a], BY_NAME[b]
    verb = "do" if fa.request_level else "does"
    what = f"{fa.title} ({detail})" if detail else fa.title if fa.request_level else f"{fa.title} ({fa.flag})"
    return error(
        f"{what} {verb} not work with {fb.title} ({fb.flag}): {r.reason}" + (" (yet)" if r.kind == NOT_YET else ""),
        param=fb.param if param is None else param,
        code=fa.code or fb.code,
    )


def refusal_error(a: str, b: str, **kw) -> KVLedgerError:
    """The error of the row of ``a`` x ``b``, for code that meets the pair where no configuration is at
    hand (a session's params, a request's prompts, a model's shards); a pair without a row is a bug."""
    e = refuse(a, b, **kw)
    if e is None:
        raise LookupError(f"the compatibility table has no row {a} x {b}")
    return e


def check_combinations(cfg: EngineConfig, device: str) -> None:
    """Refuse ``cfg`` when two of its features do not combine: one error naming both and the reason."""
    for a, b in combinations(active_features(cfg, device), 2):
        if (e := refuse(a, b)) is not None:
            raise e


def check_model(cfg: EngineConfig, device: str, model_features: list[str], detail: str = "") -> None:
    """Refuse the loaded model's ``model_features`` (model-level) where a feature of ``cfg`` does not
    combine with one: one error naming both and the reason (``detail``: which model)."""
    on = active_features(cfg, device)
    for name in model_features:
        for other in on:
            if (e := refuse(name, other, detail=detail)) is not None:
                raise e


def check_feature(cfg: EngineConfig, device: str, feature: str) -> None:
    """Refuse a feature that no setting turns on (the launcher's ``--dp-size``, a caller's KV connector)
    where a feature of ``cfg`` does not combine with it; the error's ``param`` is the feature's own."""
    for other in active_features(cfg, device):
        if (e := refuse(feature, other, param=BY_NAME[feature].param)) is not None:
            raise e


def check_request(cfg: EngineConfig, feature: str, others: tuple[str, ...] | list[str] = ()) -> None:
    """Refuse a request-level ``feature`` (400) where the request's ``others`` (request-level too) or
    the engine's features do not combine with it (``cfg``: the engine's settings, its device
    resolved). The error's ``param`` is the request's feature's."""
    for other in [*others, *active_features(cfg, cfg.model.device)]:
        if (e := refuse(feature, other, param=BY_NAME[feature].param or None)) is not None:
            raise e


def _key(i: int) -> str:
    """The ``i``-th refusal's key in the matrix: a .. z, then aa, ab, ... (never a character that
    Markdown's table syntax reads, as chr past "z" gave: "|")."""
    a = ord("a")
    return chr(a + i) if i < 26 else chr(a + i // 26 - 1) + chr(a + i % 26)


def markdown_matrix() -> str:
    """The README's compatibility matrix: every pair of fuzzed features, works or refused with its
    reason; then every other row of the table (what is refused where a request, the launcher, a
    caller or the model meets a feature)."""
    names = [f.name for f in FUZZED]
    head = "| | " + " | ".join(f"{i + 1}" for i in range(len(names))) + " |"
    rows = [head, "|---" * (len(names) + 1) + "|"]
    notes: list[str] = []
    keys: dict[frozenset[str], str] = {}
    for i, a in enumerate(FUZZED):
        cells = []
        for j, b in enumerate(FUZZED):
            pair = frozenset({a.name, b.name})
            if i == j:
                cells.append("")
            elif pair in EXCLUSIVE:
                cells.append("–")
            elif pair in REFUSED:
                if pair not in keys:
                    keys[pair] = _key(len(keys))
                    r = REFUSED[pair]
                    notes.append(f"{keys[pair]}. {a.title} x {b.title}: {r.kind}: {r.reason}.")
                cells.append(f"✗{keys[pair]}")
            else:
                cells.append("✓")
        how = f"({a.flag})" if a.model_level else f"(`{a.flag}`)"  # a model's property is no flag
        rows.append(f"| {i + 1}. {a.title} {how} | " + " | ".join(cells) + " |")
    legend = "✓ works (the combination fuzz runs it), ✗ refused (below), – one setting, two values."
    other = ["Also refused, where a request, the launcher, a caller or the model meets a feature:", ""]
    for pair, r in OTHER_REFUSALS.items():
        a, b = sorted((BY_NAME[n] for n in pair), key=FEATURES.index)
        other.append(f"- {a.title} ({a.flag}) x {b.title} ({b.flag}): {r.kind}: {r.reason}.")
    return "\n".join([*rows, "", legend, "", *notes, "", *other])


def write_readme(path: str = "README.md") -> bool:
    """Put ``markdown_matrix()`` between the README's compat-matrix markers; True when it changed."""
    return write_generated(path, "compat-matrix", markdown_matrix())


if __name__ == "__main__":  # python -m kvledger.compat [--write]: the README's matrix (printed, or written)
    import sys

    if "--write" in sys.argv[1:]:
        print("README.md: " + ("matrix regenerated" if write_readme() else "matrix current"))
    else:
        print(markdown_matrix())
