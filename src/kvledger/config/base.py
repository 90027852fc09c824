"""The building blocks of the settings: the allowed values of the enum-like settings and the CPU
defaults (their subsystems import them), one spelling per value (``_norm``), the range checks, and
each setting's one declaration (``setting``: a dataclass field whose ``Flag`` says how its flag
parses; ``declared`` lists a section's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from ..errors import ValidationError

# The allowed values of the enum-like settings (their subsystems import them from here).
DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
ATTENTION_BACKENDS = ("auto", "torch", "cpu")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # SGLang's and vLLM's names (vLLM's "fp8" is e4m3: an alias)
CPU_AMX = ("auto", "on", "off")
SAMPLING_BACKENDS = ("auto", "host", "device")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
DISAGGREGATION_MODES = ("prefill", "decode")
TRANSFER_BACKENDS = ("tcp", "mooncake")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
STORAGE_BACKENDS = ("file",)
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")  # SGLang's names (scheduler/queue_order.py)
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # SGLang's names (server/reasoning.py has their formats)
CHAT_TEMPLATES = ("chatml", "llama-3", "gemma", "mistral", "phi-3", "qwen")  # model/chat_templates.BUILTIN_TEMPLATES' names (a test keeps them equal)
TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral", "qwen", "qwen25")  # server/tools.PARSERS' names (a test keeps them equal)
POOLINGS = ("last", "mean")  # common/pooling.POOLING_METHODS (a test keeps them equal)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")  # sglang-router's
DIST_AUTH_KEY_ENV = "KVLEDGER_DIST_AUTH_KEY"  # the tensor-parallel group's key, where no key file is given
# Overlap scheduling on the CPU when --disable-overlap-schedule is not given (bench/overlap.py).
CPU_OVERLAP_DEFAULT = False
# --interleave-prefill-tokens on the CPU when not given (bench/RESULTS.md, "Prefill while decoding").
CPU_INTERLEAVE_PREFILL_TOKENS = 512
"""The prefill budget between decode steps on a CPU with AMX tiles (prefill ~3,500 tok/s on 2 cores)."""
CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX = 128
"""The same without AMX (AVX-512 VNNI/BF16 kernels; an AMD Zen 4's prefill runs at ~1,600-1,900 tok/s,
half the AMX box's): 32 streams of 128+128 tokens, vLLM's client, two runs each side by side on 2 Zen 4
cores: TTFT p50 0.24-0.37 s and 504-506 tok/s at 128 against 0.60-0.71 s and 509-563 at 512 (256:
0.37-0.43 s, 491-497 tok/s; bench/RESULTS.md)."""
CPU_MIXED_STEP_RATIO = 0.0
"""--mixed-step-ratio on the CPU when not given: off. Paced at 2.5 (a step with prompt tokens costing at
most 2.5 of the running requests' decode steps), Gemma 3 270M at 8 streams lost ~30% of its throughput
(mean 89 vs 125 tok/s, five and six runs alternating) and its TTFT p99 grew 1.6-2.6 s -> 4.1-6.4 s, for
an ITL p99 ~25% lower (bench/RESULTS.md, "2026-12-07 20:13-20:19 UTC"); the 1.2B's runs (itl54) cut
its p99/p50 from 8 to 2-3.3. Opt in with --mixed-step-ratio 2.5 where inter-token latency matters more."""

_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "fp8_e4m3"}


def _norm(value: str | None, *, upper: bool = False, null: tuple[str, ...] = ()) -> str | None:
    """One spelling of an enum-like value: stripped, one case, aliases resolved; ``null`` spellings
    (SGLang's ``null`` for "off") become None."""
    if value is None:
        return None
    v = str(value).strip()
    v = v.upper() if upper else v.lower()
    if v in null:
        return None
    return _ALIASES.get(v, v)


def _one_of(value, allowed: tuple, param: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in allowed:
        extra = " or unset" if optional else ""
        raise ValidationError(f"{param} must be one of {', '.join(allowed)}{extra}, got {value!r}", param=param)


def _positive(section, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        v = getattr(section, name)
        if v is None:
            continue
        if v < 0 or (v == 0 and not allow_zero):
            raise ValidationError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v}", param=name)


# -- Each setting declared once (issue 53): a dataclass field whose metadata says how its flag parses ----
# The field gives the name, the type, the default and (by its class) the section; ``setting`` adds the
# help and the flag's shape. argparse (cli.py), ``kvledger serve --help`` and docs/settings.md are all
# generated from these fields; tests/unit/test_cli_surface.py pins the flags they make.
VALUE, SWITCH, PAIR, TRISTATE = "value", "switch", "pair", "tristate"


@dataclass(frozen=True)
class Flag:
    """How a setting is given on the command line."""

    help: str
    flags: tuple[str, ...] = ()
    """Its option strings, the first the main one; (): ``--the-name`` (a pair: ``--enable-x``/``--disable-x``)."""
    kind: str = VALUE
    """value: ``--x V``; switch: ``--x`` sets True; pair: ``--enable-x``/``--disable-x`` set True/False;
    tristate: ``--disable-x``/``--enable-x`` set True/False, neither leaves None (the default)."""
    type: Callable[[str], Any] | None = None
    """How the value parses; None: the field's type (int, float; a string as given)."""
    choices: tuple | None = None
    nargs: str | None = None
    metavar: str | None = None
    help2: str | None = None
    """A pair's or tristate's second option's help."""

    def options(self, name: str) -> tuple[str, ...]:
        if self.flags:
            return self.flags
        if self.kind == PAIR:
            base = name.removeprefix("enable_").replace("_", "-")
            return (f"--enable-{base}", f"--disable-{base}")
        return ("--" + name.replace("_", "-"),)


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A setting's one declaration: its ``default``, its ``help`` and its flag's shape (``Flag``)."""
    return field(default=default, metadata={"flag": Flag(help, **flag)})


def declared(cls: type) -> list[tuple[Field, Flag]]:
    """The settings of a section (or of ``ServerConfig``, ``LaunchSettings``) with their flags, in order."""
    return [(f, f.metadata["flag"]) for f in fields(cls) if "flag" in f.metadata]


def value_type(f: Field) -> Callable[[str], Any] | None:
    """The parser of a value setting's flag from its annotation: int, float, else the string as given."""
    base = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float}.get(base)
