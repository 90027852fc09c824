"""An image part's bytes, read and decoded with limits, before anything is allocated: ``data:`` URLs
(base64), local files only under the directory the operator allows (``--allowed-local-media-path``),
and raw bytes (the offline API). Every failure is a 400 naming the part (``param``).

Decoding is Pillow's: the pixel count is checked against ``max_pixels`` from the header alone
(``Image.open`` reads no pixel data) before ``load`` decodes, so a decompression bomb is refused
without decoding it; Pillow's own ``MAX_IMAGE_PIXELS`` guard is kept as a second wall."""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass

from ..errors import ValidationError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow decodes that clients send


@dataclass(frozen=True)
class MediaLimits:
    """The bounds an image part is read within (the server's settings)."""

    max_image_bytes: int = 20 * 1024 * 1024  # encoded size
    max_image_pixels: int = 4096 * 4096  # width x height, checked before decoding
    allowed_local_media_path: str | None = None  # None: file paths are refused
    # Remote http(s) URLs (``remote.py``): off unless the operator allows them.
    allow_remote_media: bool = False
    allowed_media_domains: tuple[str, ...] | None = None  # None: any public host
    media_fetch_timeout_s: float = 10.0  # the whole fetch, redirects and body included
    media_max_redirects: int = 3


def image_bytes(url: str, param: str, limits: MediaLimits, fetched: dict[str, bytes] | None = None) -> bytes:
    """The encoded bytes an ``image_url``'s ``url`` names: a ``data:`` URL, a local file under the
    allowed directory, or a remote URL's body that ``remote.RemoteFetcher`` fetched beforehand
    (``fetched``, by URL; the fetch is asynchronous, this is not). Remote URLs are refused when the
    server does not allow them."""
    if not isinstance(url, str) or not url:
        raise ValidationError("image_url.url must be a non-empty string", param=param)
    if url.startswith("data:"):
        head, sep, body = url.partition(",")
        if not sep or ";base64" not in head:
            raise ValidationError("a data: image URL must be base64 (data:image/...;base64,...)", param=param)
        if len(body) * 3 // 4 > limits.max_image_bytes:
            raise ValidationError(f"image larger than {limits.max_image_bytes} bytes", param=param)
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ValidationError("image data is not valid base64", param=param) from None
    if url.startswith("file:") or url.startswith("/"):
        return _local_file(url.removeprefix("file://").removeprefix("file:"), param, limits)
    if url.startswith(("http://", "https://")):
        if not limits.allow_remote_media:
            raise ValidationError("remote image URLs are off on this server (--allow-remote-media); send a data: URL",
                                  param=param)  # fmt: skip
        if fetched is None or url not in fetched:
            raise ValidationError("remote image URLs are fetched by the HTTP server only", param=param)
        return fetched[url]
    raise ValidationError("unsupported image URL scheme (data: URLs and allowed local files)", param=param)


def _local_file(path: str, param: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise ValidationError("local image files are off (--allowed-local-media-path)", param=param)
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:  # symlinks and .. resolved first
        raise ValidationError("image file outside --allowed-local-media-path", param=param)
    try:
        size = os.path.getsize(real)
        if size > limits.max_image_bytes:
            raise ValidationError(f"image larger than {limits.max_image_bytes} bytes", param=param)
        with open(real, "rb") as f:
            return f.read(limits.max_image_bytes + 1)
    except OSError:
        raise ValidationError("image file not readable", param=param) from None


def decode_image(data: bytes, param: str, limits: MediaLimits):
    """``data`` decoded to an RGB ``PIL.Image`` (fully loaded), or a 400 naming ``param``: too large,
    too many pixels (from the header, before decoding), an unsupported format, corrupt or truncated."""
    import warnings

    from PIL import Image

    if len(data) > limits.max_image_bytes:
        raise ValidationError(f"image larger than {limits.max_image_bytes} bytes", param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            w, h = img.size
            if w * h > limits.max_image_pixels:
                raise ValidationError(
                    f"image of {w}x{h} pixels exceeds the limit of {limits.max_image_pixels}", param=param
                )
            img.load()
    except ValidationError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValidationError("image has too many pixels (decompression bomb)", param=param) from None
    except Image.UnidentifiedImageError:
        raise ValidationError(f"unsupported or unrecognised image format (accepted: {', '.join(FORMATS)})",
                              param=param) from None  # fmt: skip
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's truncated / corrupt data
        raise ValidationError(f"corrupt or truncated image ({str(e)[:100]})", param=param) from None
    return img.convert("RGB")


def load_image(obj, param: str, limits: MediaLimits):
    """An image given as a ``PIL.Image``, encoded bytes, or a URL string (``image_bytes``), decoded."""
    from PIL import Image

    if isinstance(obj, Image.Image):
        w, h = obj.size
        if w * h > limits.max_image_pixels:
            raise ValidationError(f"image of {w}x{h} pixels exceeds the limit of {limits.max_image_pixels}", param=param)
        return obj.convert("RGB")
    if isinstance(obj, (bytes, bytearray)):
        return decode_image(bytes(obj), param, limits)
    if isinstance(obj, str):
        return decode_image(image_bytes(obj, param, limits), param, limits)
    raise ValidationError("an image is a data: URL, a file path, bytes or a PIL image", param=param)
