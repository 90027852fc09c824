"""Image content parts of chat messages (OpenAI's ``image_url``; the Responses API's
``input_image`` arrives converted to one): each read and decoded with the server's limits
(``multimodal/media.py``) where it stands in the message, replaced in the text by the model's
image placeholder, and collected with the name of its part (``messages[0].content[1]``), which every
400 about it names. A part that is neither text nor an image, or an image for a text-only model,
is refused rather than dropped."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import ValidationError
from ..multimodal.media import MediaLimits, decode_image, image_bytes
from ..multimodal.processor import ImageProcessing, PreparedImage


@dataclass
class ChatImages:
    """The images of one chat request, in prompt order, with the parts that gave them."""

    images: list[Any] = field(default_factory=list)  # decoded PIL images, or ``PreparedImage``s
    params: list[str] = field(default_factory=list)
    fetched: dict[str, bytes] = field(default_factory=dict)  # remote URLs' bodies, fetched beforehand
    # Parts already read, decoded and processed off the event loop (``ImageReader``), by part name.
    prepared: dict[str, PreparedImage] = field(default_factory=dict)


def image_threads() -> int:
    """The reader pool's bound: the cores, at least 2 and at most 8 (Pillow's decode and resize,
    numpy's normalisation and the digest release the GIL for most of their time, so threads run
    them side by side; past the cores they only queue)."""
    return max(2, min(8, os.cpu_count() or 1))


class ImageReader:
    """The front's image work off its event loop: each image part's bytes read (``data:`` URL, an
    allowed file, or a fetched body), decoded by Pillow with the limits, put through the family's
    processor and hashed (``ImageProcessing.prepare``), in a bounded thread pool (``image_threads``)
    while the loop serves other requests. Every image of a request is read before the request is
    sent to the engine, so a bad one is still a 400 naming its part before anything is allocated.
    The pool starts with the first image and ends with the front (``close``)."""

    def __init__(self, processing: ImageProcessing, limits: MediaLimits, threads: int | None = None):
        self.processing = processing
        self.limits = limits
        self.threads = threads or image_threads()
        self._pool: ThreadPoolExecutor | None = None

    def _read(self, url: Any, where: str, fetched: dict[str, bytes], native: bool) -> PreparedImage:
        if native:
            url = native_url(url, where)
        img = decode_image(image_bytes(url, where, self.limits, fetched), where, self.limits)
        return self.processing.prepare(img, where)

    async def read_all(
        self, parts: list[tuple[Any, str]], fetched: dict[str, bytes] | None = None, native: bool = False
    ) -> dict[str, PreparedImage]:
        """``parts`` ((URL or ``image_data`` item, part name), at most the request's limit) read side
        by side in the pool; the first failing part's 400 (in part order) once all have ended."""
        if not parts:
            return {}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvledger-image")
        loop = asyncio.get_running_loop()
        got = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self._read, url, where, fetched or {}, native) for url, where in parts),
            return_exceptions=True,
        )
        for r in got:
            if isinstance(r, BaseException):
                raise r
        return {where: r for (_, where), r in zip(parts, got)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def is_remote(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def chat_image_parts(messages: list, max_images: int) -> list[tuple[Any, str]]:
    """A chat request's first ``max_images`` image parts, each (its URL, its part's name):
    ``content_text`` refuses the one past the limit, so nothing past it is fetched or read."""
    out: list[tuple[Any, str]] = []
    for i, m in enumerate(messages):
        content = getattr(m, "content", None)
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not (isinstance(part, dict) and part.get("type") == "image_url"):
                continue
            if len(out) == max_images:
                return out
            where = part.get("_part") if isinstance(part.get("_part"), str) else f"messages[{i}].content[{j}]"
            out.append((part_url(part), where))
    return out


def remote_chat_urls(messages: list, max_images: int) -> list[tuple[str, str]]:
    """The remote URLs (with their part's name) among a chat request's first ``max_images`` image
    parts, to fetch before the parts are read."""
    return [(url, where) for url, where in chat_image_parts(messages, max_images) if is_remote(url)]


def remote_native_urls(pairs: list[tuple[Any, str]], max_images: int) -> list[tuple[str, str]]:
    """``/generate``'s remote image URLs of one prompt (its first ``max_images``)."""
    return [(x, where) for x, where in pairs[:max_images] if is_remote(x)]


def native_images(image_data: Any, n: int, single: bool) -> list[list[tuple[Any, str]]]:
    """SGLang's ``image_data`` as each prompt's (image, part name) pairs: for one prompt an image or
    a list, for a batch one entry (an image, a list, or null) per prompt."""
    if image_data is None or image_data == []:
        return [[] for _ in range(n)]
    per = [image_data] if single else image_data
    if not isinstance(per, list) or len(per) != n:
        raise ValidationError(f"image_data must have one entry per prompt ({n})", param="image_data")
    out = []
    for k, entry in enumerate(per):
        items = [] if entry is None else entry if isinstance(entry, list) else [entry]
        out.append([(x, f"image_data[{j}]" if single else f"image_data[{k}][{j}]") for j, x in enumerate(items)])
    return out


def native_url(x: Any, param: str) -> str:
    """An ``image_data`` item as a URL ``image_bytes`` reads: a URL as it is, bare base64 as data."""
    if not isinstance(x, str) or not x:
        raise ValidationError("an image is a non-empty string (data: URL, base64 or a file path)", param=param)
    if x.startswith(("data:", "file:", "/", "http://", "https://")):
        return x
    return "data:image/*;base64," + x


def decode_images(
    pairs: list[tuple[Any, str]], processing: ImageProcessing | None, limits: MediaLimits, max_images: int,
    fetched: dict[str, bytes] | None = None, prepared: dict[str, PreparedImage] | None = None,
) -> ChatImages:  # fmt: skip
    """``/generate``'s images of one prompt, decoded (400s naming each); ``fetched``: remote URLs'
    bodies, fetched beforehand; ``prepared``: parts already read off the loop (``ImageReader``)."""
    out = ChatImages(fetched=fetched or {}, prepared=prepared or {})
    for x, where in pairs:
        if processing is None:
            raise ValidationError("this model takes no images (a text-only model)", param=where)
        if len(out.images) >= max_images:
            raise ValidationError(f"more than {max_images} images in one request (--max-images-per-prompt)",
                                  param=where)  # fmt: skip
        got = out.prepared.get(where)
        if got is None:
            got = decode_image(image_bytes(native_url(x, where), where, limits, out.fetched), where, limits)
        out.images.append(got)
        out.params.append(where)
    return out


def part_url(part: dict) -> Any:
    """An ``image_url`` part's URL (``{"url": ...}``, or the string vLLM also accepts)."""
    v = part.get("image_url")
    return v.get("url") if isinstance(v, dict) else v


def content_text(
    content: list[dict], param: str, processing: ImageProcessing | None, limits: MediaLimits, max_images: int,
    out: ChatImages,
) -> str:  # fmt: skip
    """A message's content parts as its text, image parts as the placeholder (decoded into ``out``)."""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        # A part converted from the Responses API carries its own name there (responses_input.py).
        where = part.get("_part") if kind == "image_url" and isinstance(part.get("_part"), str) else f"{param}[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            if processing is None:
                raise ValidationError("this model takes no images (a text-only model)", param=where)
            if len(out.images) >= max_images:
                raise ValidationError(f"more than {max_images} images in one request (--max-images-per-prompt)",
                                      param=where)  # fmt: skip
            got = out.prepared.get(where)
            if got is None:
                got = decode_image(image_bytes(part_url(part), where, limits, out.fetched), where, limits)
            out.images.append(got)
            out.params.append(where)
            texts.append(processing.chat_placeholder)
        else:
            raise ValidationError(
                f"{where} must be a text part or an image_url part; got {str(part)[:80]}", param=where
            )
    return "".join(texts)
