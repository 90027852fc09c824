"""Every optional field of every route, sent as JSON null, is answered as if left out (issue 56:
``{"stream": null}``, ``{"n": null}``, ``{"store": null}`` were 400s); the books clean after."""

from __future__ import annotations

from tests.nulls import null_bodies, walk


def test_null_is_not_given_on_every_route(srv):
    assert len(null_bodies()) > 300  # every route's fields, their nested bodies and peer fields
    assert walk(srv.url) == []
