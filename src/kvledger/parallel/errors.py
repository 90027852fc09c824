"""Errors of the tensor-parallel group (kept apart so the engine core imports no distributed code)."""


class TPGroupBroken(RuntimeError):
    """A rank died or a collective failed: the group cannot go on (the engine restarts)."""
