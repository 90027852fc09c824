"""Errors of the tensor-parallel group: a broken group (``TPGroupBroken``, raised by the collectives,
``comm.py``) and how a rank finds out."""

from ..comm import TPGroupBroken

__all__ = ["FrameError", "TPAuthError", "TPGroupBroken"]


class FrameError(TPGroupBroken):
    """A frame from another rank did not decode into the type expected there (malformed, oversized, or
    of another type): nothing of it is used, and the group cannot be trusted to be in step."""


class TPAuthError(TPGroupBroken):
    """The rendezvous did not prove it holds this rank's key, or a value in it never did: this rank
    does not join (``parallel/rendezvous.py``)."""
