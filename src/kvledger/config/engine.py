"""``EngineConfig``: the engine's settings in their sections, its flat view (one name per flag: what
the CLI, the offline ``Engine``, the engine process and ``/get_server_info`` speak), and its check."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from .distributed import DisaggregationSettings, ParallelSettings
from .memory import CacheSettings, HiCacheSettings, HiSparseSettings
from .model import KernelSettings, LoraSettings, ModelSettings
from .scheduling import SchedulerSettings, SpeculativeSettings


@dataclass
class EngineConfig:
    """Settings of the engine core, in sections. ``None`` values mean "derive a sensible value from
    the model and the machine"."""

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    hicache: HiCacheSettings = field(default_factory=HiCacheSettings)
    hisparse: HiSparseSettings = field(default_factory=HiSparseSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    spec: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    disagg: DisaggregationSettings = field(default_factory=DisaggregationSettings)
    kernels: KernelSettings = field(default_factory=KernelSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)

    SECTIONS: ClassVar[tuple[str, ...]] = (
        "model", "cache", "hicache", "hisparse", "scheduler", "parallel", "spec", "disagg", "kernels", "lora",
    )  # fmt: skip

    # -- the flat view: one name per flag ----------------------------------------------------------------
    @classmethod
    def section_of(cls) -> dict[str, str]:
        """Flat setting name -> the section that holds it."""
        return _SECTION_OF

    @classmethod
    def from_flat(cls, **values: Any) -> EngineConfig:
        """Build from flat names (the CLI's, the offline ``Engine``'s keyword arguments, the engine
        process's payload); an unknown name is a ``TypeError`` naming it."""
        unknown = set(values) - set(_SECTION_OF)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        parts: dict[str, dict] = {s: {} for s in cls.SECTIONS}
        for name, v in values.items():
            parts[_SECTION_OF[name]][name] = v
        return cls(**{s: _SECTION_TYPES[s](**kw) for s, kw in parts.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name (JSON-ready: what crosses processes and /get_server_info shows)."""
        return {f.name: getattr(getattr(self, s), f.name) for s in self.SECTIONS for f in fields(getattr(self, s))}

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (flat names), normalised like any new value."""
        return EngineConfig.from_flat(**{**self.flat(), **changes})

    # -- checks ------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Each section's own check: the values alone, in ``SECTIONS`` order. What needs the world
        outside the values (the device, the disk, the environment, which features combine) is the
        composition root's ``launch/validate.check_settings``, which runs this first; the CLI runs
        that before starting anything (a bad flag is one line of error, exit 2), the engine again."""
        for s in self.SECTIONS:
            getattr(self, s).check()


_SECTION_TYPES = {f.name: f.default_factory for f in fields(EngineConfig)}
_SECTION_OF: dict[str, str] = {}
for _section, _cls in _SECTION_TYPES.items():
    for _f in fields(_cls):
        if _f.name in _SECTION_OF:
            raise TypeError(f"setting {_f.name} is in two sections")
        _SECTION_OF[_f.name] = _section
