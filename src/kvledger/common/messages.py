"""Typed messages between the HTTP front and the engine process, and their one codec.

JSON on the wire (msgspec), never pickle: request data comes from clients. Each message is a
tagged struct, so a decoder gives back the right class or raises on a malformed frame.

front -> engine: ``AddRequest``, ``AbortRequest``, ``Call`` (control operations), ``Shutdown``
engine -> front: ``Ready``, ``Fatal``, ``Outputs`` (step outputs and ledger stats), ``Reply``
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .disagg import DisaggParams
from .outputs import RequestOutput
from .pooling import PoolingParams
from .sampling import SamplingParams


def ipc_paths(ipc_dir: str, generation: int) -> tuple[str, str]:
    """The two sockets (to the engine, from it) of one engine generation in the front's private
    directory: a restarted engine never receives messages meant for a dead one."""
    return (f"ipc://{ipc_dir}/to_engine_{generation}", f"ipc://{ipc_dir}/from_engine_{generation}")


class WireImage(msgspec.Struct):
    """One image of a request as it crosses to the engine (``multimodal/inputs.py``): its run of
    placeholder tokens, content digest, float32 pixel values (raw bytes and shape), and the
    processor's other per-image outputs, integers by name as (shape, values): Qwen2-VL's grid."""

    offset: int
    length: int
    digest: bytes
    pixels: bytes
    shape: list[int]
    extra: dict[str, tuple[list[int], list[int]]] = {}


class AddRequest(msgspec.Struct, tag="add"):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    session_params: dict[str, Any] | None = None
    disagg: DisaggParams | None = None  # PD: the request's bootstrap room
    pooling: PoolingParams | None = None  # an embedding or score request (no decode)
    images: list[WireImage] | None = None  # its images, whose placeholder runs input_ids holds


class AbortRequest(msgspec.Struct, tag="abort"):
    rid: str
    message: str = "aborted by the client"


class Call(msgspec.Struct, tag="call"):
    """A control operation (``flush_cache``, ``memory``, ``audit``, ``open_session``, ...)."""

    id: int
    op: str
    args: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    pid: int
    info: dict[str, Any]
    limits: dict[str, Any]
    config: dict[str, Any]


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


class Outputs(msgspec.Struct, tag="outputs"):
    items: list[RequestOutput]
    stats: dict[str, Any] | None = None


class Reply(msgspec.Struct, tag="reply"):
    id: int
    result: Any = None
    error: dict[str, Any] | None = None  # the OpenAI error object plus its HTTP "status"


ToEngine = Union[AddRequest, AbortRequest, Call, Shutdown]  # noqa: UP007 - msgspec needs a Union object
FromEngine = Union[Ready, Fatal, Outputs, Reply]  # noqa: UP007

_encoder = msgspec.json.Encoder()
_to_engine = msgspec.json.Decoder(ToEngine)
_from_engine = msgspec.json.Decoder(FromEngine)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(frame: bytes) -> AddRequest | AbortRequest | Call | Shutdown:
    return _to_engine.decode(frame)


def decode_from_engine(frame: bytes) -> Ready | Fatal | Outputs | Reply:
    return _from_engine.decode(frame)
