"""The engine health check: the one request ``/health_generate`` runs through the engine and its one
release path (the combination fuzz sends the same one, so what it proves is what the route does).
On a PD server it carries SGLang's fake bootstrap room: prefill computes and sends nothing; decode
receives nothing and ends on its first ("prebuilt") token -- seed 003's path."""

from __future__ import annotations

from .disagg import FAKE_BOOTSTRAP_HOST, DisaggParams

HEALTH_CHECK_IDS: tuple[int, ...] = (1,)
HEALTH_CHECK_SAMPLING: dict = {"max_new_tokens": 1, "temperature": 0}


def health_check_disagg(pd: bool) -> DisaggParams | None:
    """The health check's bootstrap room: the fake one on a PD server, none elsewhere."""
    return DisaggParams(FAKE_BOOTSTRAP_HOST, None, 0) if pd else None
