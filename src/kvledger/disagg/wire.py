"""The built-in KV transport's wire format (over ZMQ, TCP).

A message is one or two ZMQ frames. Frame 0 is the header: the magic ``b"KVL"``, a version byte, then
a msgpack-encoded tagged struct (typed: a decoder gives the right class or raises). Frame 1, only
after a ``KVData`` header, is the raw K/V bytes of ``count`` tokens, laid out ``[2, layers, kv_heads,
count, head_dim]`` in the sender's dtype; its length must equal ``count * Layout.bytes_per_token``.
Never pickle: a peer is another machine.

decode -> prefill: ``Claim`` (I hold pages for this room: send me tokens ``start..num_tokens``),
``Ack`` (all received: free yours), ``Fail`` (this room is off: I aborted, or refused the request).
A session turn's claim carries its whole prompt (``tokens``): the session lives on the decode side,
so only decode knows the history the turn's input is appended to; prefill computes the KV of all of
it (its own prefix cache helps) and sends ``start..num_tokens``, what decode's session lacks.

Version 2: ``Claim.tokens`` (version 1 had no way to send a prompt the prefill side was not given).
prefill -> decode: ``KVData`` + payload, ``Done`` (the last KV frame sent; here is the first sampled
token), ``Fail`` (this room will never be sent: the prefill failed, or the claim was refused).
"""

from __future__ import annotations

import zlib
from typing import Union

import msgspec

MAGIC = b"KVL"
VERSION = 2
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


def tokens_crc(ids: list[int], adapter: str | None = None) -> int:
    """A cheap check that both sides hold the same prompt (not a security boundary) under the same
    LoRA adapter (its fingerprint; None: the base model): KV computed under one adapter is never
    handed to a request of another (refused as a prompt that differs)."""
    crc = zlib.crc32(b"".join(int(t).to_bytes(4, "little", signed=False) for t in ids))
    return crc if adapter is None else zlib.crc32(b"lora:" + adapter.encode(), crc)
