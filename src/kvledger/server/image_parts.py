"""Image content parts of chat messages (OpenAI's ``image_url``; the Responses API's
``input_image`` arrives converted to one): each read and decoded with the server's limits
(``multimodal/media.py``) where it stands in the message, replaced in the text by the model's
image placeholder, and collected with the name of its part (``messages[0].content[1]``), which every
400 about it names. A part that is neither text nor an image, or an image for a text-only model,
is refused rather than dropped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ValidationError
from ..multimodal.media import MediaLimits, decode_image, image_bytes
from ..multimodal.processor import ImageProcessing


@dataclass
class ChatImages:
    """The images of one chat request, in prompt order, with the parts that gave them."""

    images: list[Any] = field(default_factory=list)  # decoded PIL images
    params: list[str] = field(default_factory=list)
    fetched: dict[str, bytes] = field(default_factory=dict)  # remote URLs' bodies, fetched beforehand


def is_remote(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def remote_chat_urls(messages: list, max_images: int) -> list[tuple[str, str]]:
    """The remote URLs (with their part's name) among a chat request's first ``max_images`` image
    parts, to fetch before the parts are read (``content_text`` refuses the one past the limit, so
    nothing past it is fetched)."""
    out: list[tuple[str, str]] = []
    seen = 0
    for i, m in enumerate(messages):
        content = getattr(m, "content", None)
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not (isinstance(part, dict) and part.get("type") == "image_url"):
                continue
            seen += 1
            if seen > max_images:
                return out
            url = part_url(part)
            if is_remote(url):
                where = part.get("_part") if isinstance(part.get("_part"), str) else f"messages[{i}].content[{j}]"
                out.append((url, where))
    return out


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
    fetched: dict[str, bytes] | None = None,
) -> ChatImages:  # fmt: skip
    """``/generate``'s images of one prompt, decoded (400s naming each); ``fetched``: remote URLs'
    bodies, fetched beforehand."""
    out = ChatImages(fetched=fetched or {})
    for x, where in pairs:
        if processing is None:
            raise ValidationError("this model takes no images (a text-only model)", param=where)
        if len(out.images) >= max_images:
            raise ValidationError(f"more than {max_images} images in one request (--max-images-per-prompt)",
                                  param=where)  # fmt: skip
        data = image_bytes(native_url(x, where), where, limits, out.fetched)
        out.images.append(decode_image(data, where, limits))
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
            url = part_url(part)
            out.images.append(decode_image(image_bytes(url, where, limits, out.fetched), where, limits))
            out.params.append(where)
            texts.append(processing.chat_placeholder)
        else:
            raise ValidationError(
                f"{where} must be a text part or an image_url part; got {str(part)[:80]}", param=where
            )
    return "".join(texts)
