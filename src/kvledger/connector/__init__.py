"""KV connectors: where KV comes from and goes to beyond the local pool (see ``base.py``)."""

from .base import KVConnector, NoOpConnector, Received
from .multi import MultiConnector

__all__ = ["KVConnector", "MultiConnector", "NoOpConnector", "Received"]
