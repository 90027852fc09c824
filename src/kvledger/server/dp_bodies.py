"""What the DP front reads of a request before it routes it (the session a turn names, the stored
response a request needs), and a body as a replica reads it, for the router's stricter parser."""

from __future__ import annotations

import json

ANY_MODEL = "default"  # every replica's alias of its served model (an answer names the served model)


def session_of(path: str, body: bytes) -> str | None:
    """The session a /generate turn, a /close_session or an /open_session names, or None."""
    if path == "/generate" and b"session_params" not in body:
        return None  # the common case, without parsing the body
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    if path in ("/close_session", "/open_session"):
        sid = doc.get("session_id")
    else:
        sp = doc.get("session_params")
        sid = sp.get("id") if isinstance(sp, dict) else None
    return sid if isinstance(sid, str) else None


def stored_response(method: str, path: str, body: bytes) -> str | None:
    """The stored response a request needs (a follow-up's ``previous_response_id``, or the id of a
    retrieve, delete or cancel), or None."""
    if path.startswith("/v1/responses/"):
        return path.removeprefix("/v1/responses/").removesuffix("/cancel") or None
    if method != "POST" or path != "/v1/responses" or b"previous_response_id" not in body:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    prev = doc.get("previous_response_id") if isinstance(doc, dict) else None
    return prev if isinstance(prev, str) else None


def as_the_server_reads(body: bytes, with_model: bool) -> bytes:
    """``body`` as a replica reads it, for the router's stricter parser: JSON null is "not given"
    (dropped from the body, its messages and stream options) and no ``model`` is the served one."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body  # not JSON: a replica's 400 would say so; the router's is put into that shape
    if not isinstance(doc, dict):
        return body
    doc = _unset_nulls(doc)
    if isinstance(doc.get("messages"), list):
        doc["messages"] = [_message(m) if isinstance(m, dict) else m for m in doc["messages"]]
    if isinstance(doc.get("stream_options"), dict):
        doc["stream_options"] = _unset_nulls(doc["stream_options"])
    if with_model:
        doc.setdefault("model", ANY_MODEL)
    return json.dumps(doc).encode()


def _message(m: dict) -> dict:
    out = _unset_nulls(m)
    if "content" in m and m["content"] is None:  # the server reads a null content as "" (chat_input)
        out["content"] = ""
    return out


def _unset_nulls(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if v is not None}
