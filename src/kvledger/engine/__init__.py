"""The engine: the step (``core.py``) over the parts the composition root builds (``launch/``), the
model runner and executor it drives, its control verbs and its introspection."""

from .core import EngineCore

__all__ = ["EngineCore"]
