"""The OpenAI-client suite (tests/openai_suite.py) against one server; the ``--dp-size 2`` front runs
the same suite in test_dp_sessions.py and a PD pair the parts it serves in test_pd_router.py."""

from __future__ import annotations

from tests import openai_suite


def test_the_openai_client_suite(srv):
    openai_suite.run(srv.url)
