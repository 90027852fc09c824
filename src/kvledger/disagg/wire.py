"""The built-in KV transport's wire format (over ZMQ, TCP).

A message is two or three ZMQ frames. Frame 0 is the header: the magic ``b"KVL"``, a version byte,
then a msgpack-encoded tagged struct (typed: a decoder gives the right class or raises). Frame 1, only
after a ``KVData`` header, is the raw K/V bytes of ``count`` tokens, laid out ``[2, layers, kv_heads,
count, head_dim]`` in the sender's dtype; its length must equal ``count * Layout.bytes_per_token``.
The last frame is the seal (``auth.py``): the HMAC of the frames before it under the PD nodes' shared
key, with the sender's session and sequence number against replays. A receiver opens the seal before
it parses anything (``unpack``). Never pickle: a peer is another machine.

decode -> prefill: ``Claim`` (I hold pages for this room: send me tokens ``start..num_tokens``),
``Ack`` (all received: free yours), ``Fail`` (this room is off: I aborted, or refused the request).
A session turn's claim carries its whole prompt (``tokens``): the session lives on the decode side,
so only decode knows the history the turn's input is appended to; prefill computes the KV of all of
it (its own prefix cache helps) and sends ``start..num_tokens``, what decode's session lacks.

Version 2: ``Claim.tokens`` (version 1 had no way to send a prompt the prefill side was not given).
Version 3: the seal frame (versions 1 and 2 trusted anything that reached the bootstrap port).
prefill -> decode: ``KVData`` + payload, ``Done`` (the last KV frame sent; here is the first sampled
token), ``Fail`` (this room will never be sent: the prefill failed, or the claim was refused).
"""

from __future__ import annotations

import zlib
from typing import Union

import msgspec

from .auth import AuthError, Opener, Sealer

MAGIC = b"KVL"
VERSION = 3
# A Mooncake claim lists its pages (8 bytes or so per page), a session turn's its prompt (up to 5 per
# token): either fits a context of several hundred thousand tokens.
MAX_HEADER_BYTES = 4 * 1024 * 1024


class WireError(Exception):
    """A frame that is not a valid message of this version (logged and counted, never fatal)."""


class Layout(msgspec.Struct, frozen=True):
    """What a K/V byte means. Both sides must agree or the transfer is refused."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    itemsize: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.itemsize


class MooncakeTarget(msgspec.Struct, frozen=True):
    """Where a Mooncake write goes (``mooncake.py``): the decode side's engine and KV tensors
    (``[layers, kv_heads, num_locations, head_dim]`` each) and the pages of the claimed positions."""

    session: str  # "host:rpc_port" of the decode side's transfer engine
    k_base: int
    v_base: int
    num_locations: int
    page_size: int
    pages: list[int]  # pages of positions start..num_tokens (from page start // page_size)


class Claim(msgspec.Struct, tag="claim"):
    room: int
    num_tokens: int  # the prompt's length
    start: int  # tokens before this come from decode's own prefix cache
    tokens_crc: int  # crc32 of the prompt's token ids: the same prompt on both sides
    layout: Layout
    mooncake: MooncakeTarget | None = None  # None: send the KV as KVData frames
    # A session turn's whole prompt (the session's tokens up to its offset + the turn's input), which
    # the prefill side computes instead of the body it was sent; None: the body's prompt.
    tokens: list[int] | None = None


class KVData(msgspec.Struct, tag="kv"):
    room: int
    start: int
    count: int


class Done(msgspec.Struct, tag="done"):
    room: int
    num_tokens: int  # tokens sent in all: start..num_tokens
    first_token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    direct: bool = False  # the KV was written into decode's pages by Mooncake (no KVData frames)
    cached_tokens: int = 0  # prompt tokens prefill took from its own cache (the rest it computed)


class Ack(msgspec.Struct, tag="ack"):
    room: int


class Fail(msgspec.Struct, tag="fail"):
    room: int
    reason: str


Message = Union[Claim, KVData, Done, Ack, Fail]  # noqa: UP007 - msgspec needs a Union object

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: msgspec.Struct) -> bytes:
    return MAGIC + bytes([VERSION]) + _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    """Header frame -> message; ``WireError`` for anything else (wrong magic, version, type, size)."""
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frame)} bytes (limit {MAX_HEADER_BYTES})")
    if frame[:3] != MAGIC or len(frame) < 4:
        raise WireError("not a kvledger transfer frame")
    if frame[3] != VERSION:
        raise WireError(f"wire version {frame[3]} (this side speaks {VERSION})")
    try:
        return _decoder.decode(frame[4:])
    except msgspec.DecodeError as e:
        raise WireError(f"malformed header: {e}") from None


def pack(msg: msgspec.Struct, sealer: Sealer, payload=None) -> list:
    """The frames of one message: header, the payload (``KVData`` only), the seal."""
    parts = [encode(msg)] if payload is None else [encode(msg), payload]
    return [*parts, sealer.seal(parts)]


def unpack(frames, opener: Opener) -> tuple[Message, memoryview | None]:
    """A received message's frames (a ROUTER's identity frame removed) -> (message, payload or None).
    ``WireError`` for anything that is not one authentic message of this version: the seal is opened
    first (``auth.py``), so nothing of an unauthenticated frame is parsed."""
    if not 2 <= len(frames) <= 3:
        raise WireError(f"{len(frames)} frames where a message has 2 or 3")
    parts = [_view(f) for f in frames]
    if parts[0].nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {parts[0].nbytes} bytes (limit {MAX_HEADER_BYTES})")
    try:
        opener.open(parts[:-1], parts[-1])
    except AuthError as e:
        raise WireError(str(e)) from None
    msg = decode(bytes(parts[0]))
    if (len(parts) == 3) != isinstance(msg, KVData):
        raise WireError(f"a {type(msg).__name__} message in {len(parts)} frames")
    return msg, parts[1] if len(parts) == 3 else None


def _view(frame) -> memoryview:
    """A received frame's bytes without a copy (a ``zmq.Frame`` or bytes-like)."""
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf)


def tokens_crc(ids: list[int], adapter: str | None = None, images: tuple[bytes, ...] = ()) -> int:
    """A cheap check that both sides hold the same prompt (not a security boundary) under the same
    LoRA adapter (its fingerprint; None: the base model) with the same images (their content digests,
    in prompt order: an image's placeholder tokens are the same ids whatever the picture): KV computed
    under one adapter or of one picture is never handed to a request of another (refused as a prompt
    that differs)."""
    crc = zlib.crc32(b"".join(int(t).to_bytes(4, "little", signed=False) for t in ids))
    if adapter is not None:
        crc = zlib.crc32(b"lora:" + adapter.encode(), crc)
    for digest in images:
        crc = zlib.crc32(b"image:" + digest, crc)
    return crc


def prompt_crc(req, ids: list[int] | None = None) -> int:
    """``tokens_crc`` of a request's prompt (``ids``, else its own), adapter and images."""
    images = tuple(im.digest for im in req.mm.images) if req.mm is not None else ()
    return tokens_crc(req.input_ids if ids is None else ids, req.lora_key, images)
