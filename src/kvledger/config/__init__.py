"""The settings: ``EngineConfig`` in sections (as vLLM splits its config), and ``ServerConfig``.

Each section is a dataclass with its own ``check()`` (the values a section can judge alone) and
normalises its enum-like values once, where they enter (``__post_init__``): ``"standalone"`` and
``"STANDALONE"`` are one algorithm from then on, and nothing outside this package compares raw
spellings. Which features combine is not a section's business: ``compat.py`` owns that table, and
``EngineConfig.check`` runs the sections' checks, then the table.

Each setting is declared once, in this package: a field made with ``setting(default, help, ...)``
gives its name, type, default, section (its class), help and how its flag parses (``Flag``). argparse
and ``kvledger serve --help`` (cli.py) and docs/settings.md (``settings_markdown``; ``python -m
kvledger.config --write``) are generated from these fields. A field's docstring says why its default
is what it is.

Field names are the CLI flags' (``--page-size`` <-> ``cache.page_size``), so the flat view
(``EngineConfig.from_flat`` / ``flat``) that the CLI, the offline ``Engine(**kwargs)``, the engine
process and ``/get_server_info`` speak maps 1:1 onto the sections.

The package, by job: ``base.py`` (the allowed values, one spelling per value, the range checks,
``setting``/``Flag``), the sections (``model.py``: model, kernels, LoRA; ``memory.py``: cache, tiers,
HiSparse; ``scheduling.py``: scheduler, speculative; ``distributed.py``: parallel, disaggregation),
``engine.py`` (``EngineConfig``), ``server.py`` (``ServerConfig``, ``LaunchSettings``) and
``docs.py`` (docs/settings.md's tables). Every name is imported from ``kvledger.config``.
"""

from .base import (
    ATTENTION_BACKENDS,
    CHAT_TEMPLATES,
    CPU_AMX,
    CPU_INTERLEAVE_PREFILL_TOKENS,
    CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX,
    CPU_OVERLAP_DEFAULT,
    DISAGGREGATION_MODES,
    DIST_AUTH_KEY_ENV,
    DTYPES,
    KV_CACHE_DTYPES,
    PAIR,
    POOLINGS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    ROUTER_POLICIES,
    SAMPLING_BACKENDS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    STORAGE_BACKENDS,
    SWITCH,
    TOOL_CALL_PARSERS,
    TRANSFER_BACKENDS,
    TRISTATE,
    VALUE,
    WRITE_POLICIES,
    Flag,
    declared,
    setting,
    value_type,
)
from .distributed import (
    DisaggregationSettings,
    ParallelSettings,
)
from .docs import (
    SETTINGS_DOC_SECTIONS,
    settings_markdown,
    write_generated,
    write_settings_doc,
)
from .engine import (
    EngineConfig,
)
from .memory import (
    CacheSettings,
    HiCacheSettings,
    HiSparseSettings,
)
from .model import (
    KernelSettings,
    LoraSettings,
    ModelSettings,
)
from .scheduling import (
    SchedulerSettings,
    SpeculativeSettings,
)
from .server import (
    LaunchSettings,
    ServerConfig,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "CHAT_TEMPLATES",
    "CPU_AMX",
    "CPU_INTERLEAVE_PREFILL_TOKENS",
    "CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX",
    "CPU_OVERLAP_DEFAULT",
    "DISAGGREGATION_MODES",
    "DIST_AUTH_KEY_ENV",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "PAIR",
    "POOLINGS",
    "QUANTIZATIONS",
    "REASONING_PARSERS",
    "ROUTER_POLICIES",
    "SAMPLING_BACKENDS",
    "SCHEDULE_POLICIES",
    "SETTINGS_DOC_SECTIONS",
    "SPECULATIVE_ALGORITHMS",
    "STORAGE_BACKENDS",
    "SWITCH",
    "TOOL_CALL_PARSERS",
    "TRANSFER_BACKENDS",
    "TRISTATE",
    "VALUE",
    "WRITE_POLICIES",
    "CacheSettings",
    "DisaggregationSettings",
    "EngineConfig",
    "Flag",
    "HiCacheSettings",
    "HiSparseSettings",
    "KernelSettings",
    "LaunchSettings",
    "LoraSettings",
    "ModelSettings",
    "ParallelSettings",
    "SchedulerSettings",
    "ServerConfig",
    "SpeculativeSettings",
    "declared",
    "setting",
    "settings_markdown",
    "value_type",
    "write_generated",
    "write_settings_doc",
]
