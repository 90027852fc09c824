"""Engine core, model runner and the offline ``Engine`` API."""

from .core import EngineCore
from .engine import Engine

__all__ = ["Engine", "EngineCore"]
