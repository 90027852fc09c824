"""Streaming sessions: one conversation's KV kept between turns.

This module is the lifecycle (open, close, expiry, caps, making a request a turn); the pages are
``memory/session_kv.py``'s, and a turn's KV is committed or dropped in the one release path.

Rules: one turn at a time (409); closing while a turn runs defers the release to its finish; turns to a
closing or closed session get 404; idle sessions expire after their timeout; at most ``max_sessions``
(429 on open). Session KV never blocks a normal request: when the pool is short, idle sessions' KV is
dropped, least recently used first (their tokens are kept and recomputed on the next turn).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

import msgspec

from ..compat import refusal_error
from ..errors import ConflictError, NotFoundError, OverloadedError, ValidationError
from ..memory import Session, SessionKV
from ..multimodal import MultiModalInputs


def session_not_found(sid, param: str) -> NotFoundError:
    """The one answer for a session that is not there (closed, expired, never opened) -- and, in the
    HTTP front, for one that is another key's (``server/session_store.py``): the same words, so that
    the answer does not tell them apart."""
    return NotFoundError(f"no open session {sid!r}", param=param, code="session_not_found")


class SessionManager:
    def __init__(
        self, session_kv: SessionKV, max_sessions: int, default_timeout_s: float | None, page_size: int
    ):
        self.session_kv = session_kv
        self.max_sessions = max_sessions
        self.default_timeout_s = default_timeout_s
        self.page_size = page_size
        self.sessions: dict[str, Session] = session_kv.by_id  # one registry: the memory side's

    # -- open / close -------------------------------------------------------------------------------------
    def open(self, session_id: str | None = None, timeout: float | None = None) -> str:
        if session_id is not None and (not isinstance(session_id, str) or not 0 < len(session_id) <= 256):
            raise ValidationError("session_id must be a string of 1 to 256 characters", param="session_id")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ValidationError("timeout must be a positive number of seconds", param="timeout")
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise ConflictError(f"session {sid!r} already exists", param="session_id", code="session_exists")
        if len(self.sessions) >= self.max_sessions:
            raise OverloadedError(
                f"too many open sessions (at most {self.max_sessions})", code="too_many_sessions"
            )
        self.sessions[sid] = Session(sid, timeout if timeout is not None else self.default_timeout_s)
        return sid

    def restore(self, records: list[dict], vocab_size: int, context_length: int) -> int:
        """Re-open sessions a previous engine held (the front kept them across a restart), with their
        tokens and no KV: the next turn recomputes it. ``idle_s`` (how long each has been idle) keeps
        its expiry where it was. Returns how many were restored."""
        n = 0
        for r in records:
            tokens, idle = r.get("tokens"), r.get("idle_s", 0.0)
            if not (
                isinstance(tokens, list)
                and len(tokens) < context_length
                and all(type(t) is int and 0 <= t < vocab_size for t in tokens)
            ):
                raise ValidationError("a restored session's tokens must be ids of this model's vocabulary")
            if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0 <= idle < math.inf:
                raise ValidationError("a restored session's idle_s must be a number of seconds >= 0")
            self.open(r.get("id"), r.get("timeout"))
            s = self.sessions[r["id"]]
            s.tokens = tokens
            s.last_used -= idle
            n += 1
        return n

    def close(self, session_id: str) -> None:
        s = self.sessions.get(session_id)
        if s is None or s.closing:
            raise session_not_found(session_id, "session_id")
        if s.busy_rid is not None:
            s.closing = True  # released by the running turn's finish, through the release path
            return
        self.session_kv.release(s)

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        gone = []
        for s in list(self.sessions.values()):
            if s.busy_rid is None and s.timeout_s is not None and now - s.last_used > s.timeout_s:
                self.session_kv.release(s)
                gone.append(s.id)
        return gone

    # -- turns --------------------------------------------------------------------------------------------
    def check_params(self, req, params: dict) -> None:
        """What a turn may ask, checked where the session is not held (PD prefill) as where it is."""
        if not isinstance(params, dict):
            raise ValidationError("session_params must be an object", param="session_params")
        unknown = set(params) - {"id", "offset", "replace", "rid"}
        if unknown:
            raise ValidationError(f"unknown session_params: {sorted(unknown)}", param="session_params")
        if params.get("replace"):
            raise ValidationError(
                "session_params.replace is not supported; use offset to rewind",
                param="session_params.replace",
            )
        if params.get("rid") is not None:
            raise ValidationError(
                "session_params.rid (branching) is not supported; use offset to rewind",
                param="session_params.rid",
            )
        if req.params.logprob_start_len >= 0:
            raise refusal_error("prompt_logprobs", "sessions", param="logprob_start_len")

    def attach(self, req, params: dict, context_length: int) -> None:
        """Make ``req`` a turn of the session named in ``params`` (its prompt becomes history + input)."""
        self.check_params(req, params)
        sid = params.get("id")
        s = self.sessions.get(sid) if isinstance(sid, str) else None
        if s is None or s.closing:
            raise session_not_found(sid, "session_params.id")
        if s.busy_rid is not None:
            raise ConflictError(
                f"session {sid!r} is busy with request {s.busy_rid!r}; one turn at a time",
                param="session_params.id",
                code="session_busy",
            )
        offset = params.get("offset")
        if offset is None:
            offset = len(s.tokens)
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= len(s.tokens):
            raise ValidationError(
                f"session_params.offset must be an integer in [0, {len(s.tokens)}]",
                param="session_params.offset",
            )
        images = self._turn_images(s, req, offset)
        prompt = s.tokens[:offset] + req.input_ids
        if len(prompt) >= context_length:
            raise ValidationError(
                f"this turn makes the conversation {len(prompt)} tokens long; the context is {context_length}",
                param="input_ids",
                code="context_length_exceeded",
            )
        req.input_ids = prompt
        req.mm = images
        left = context_length - len(prompt)  # (a copy: params may be the caller's, shared by several requests)
        req.params = msgspec.structs.replace(req.params, max_new_tokens=min(req.params.max_new_tokens, left))
        req.session = s
        req.session_offset = offset
        s.busy_rid = req.rid
        s.last_used = time.monotonic()

    @staticmethod
    def _turn_images(s: Session, req, offset: int) -> MultiModalInputs | None:
        """The images of a turn's whole prompt: the history's up to ``offset`` (a rewind into an image's
        tokens is refused: half an image is no image), then the turn's own, moved past the history."""
        history = tuple(im for im in s.images if im.offset < offset)
        if history and history[-1].end > offset:
            raise ValidationError(
                f"session_params.offset {offset} falls inside an image's tokens "
                f"[{history[-1].offset}, {history[-1].end}); rewind to before or after it",
                param="session_params.offset",
            )
        own = tuple(dataclasses.replace(im, offset=im.offset + offset) for im in req.mm.images) if req.mm else ()
        return MultiModalInputs(history + own) if history or own else None

    def describe(self) -> list[dict]:
        return [
            {
                "id": s.id,
                "tokens": len(s.tokens),
                "kv_tokens": s.kv_len,
                "held_tokens": (len(s.pages) - s.num_out) * self.page_size,
                "busy_rid": s.busy_rid,
                "closing": s.closing,
                "turns": s.turns,
                **({"images": len(s.images)} if s.images else {}),
            }
            for s in self.sessions.values()
        ]
