"""The composition root (``build.py``: settings -> ``EngineParts`` -> ``EngineCore``), and the two
ways an engine runs: in its own process behind the HTTP front (``process.py``) and in-process (the
offline ``Engine``, ``offline.py``)."""

from .build import EngineParts, build_parts, start_engine
from .offline import Engine

__all__ = ["Engine", "EngineParts", "build_parts", "start_engine"]
