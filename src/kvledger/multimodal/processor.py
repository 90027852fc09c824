"""The family's own image preprocessing: transformers' processor saved beside the model
(``AutoProcessor``) resizes and normalises each image and says how many placeholder tokens it
takes; nothing of its arithmetic is copied here.

``ImageProcessing.expand`` turns a prompt whose image placeholders are one token each (the chat
template's ``<image>``) into the prompt the model reads — each placeholder repeated as many times
as its image has tokens — and the ``MultiModalInputs`` that say where each image's run is."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ValidationError
from .inputs import ImageItem, MultiModalInputs

# The families whose image processor gives a patch grid (``image_grid_thw``) per image: their
# token count is the grid's product over the merge size squared (their processor's
# ``replace_image_token``), and a chat message's image is ``<|vision_start|><|image_pad|><|vision_end|>``.
GRID_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """A decoded image through the family's processor (``ImageProcessing.prepare``), ready for
    ``expand``: the HTTP front prepares its requests' images off the event loop (``ImageReader``)."""

    pixels: np.ndarray  # float32, the processor's pixel values
    length: int  # the image's token count
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # the processor's other per-image outputs
    digest: bytes = b""  # ``content_digest(pixels, extra)``


class ImageProcessing:
    """One model's image processor and its placeholder token. ``chat_placeholder``: what a chat
    message's image part becomes in the text the chat template reads (the placeholder token, in
    the markers the family's template writes around it)."""

    def __init__(self, processor: Any, image_token: str, image_token_id: int, chat_placeholder: str | None = None):
        self.processor = processor
        self.image_token = image_token
        self.image_token_id = image_token_id
        self.chat_placeholder = chat_placeholder or image_token

    @classmethod
    def load(cls, path: str, image_token_id: int) -> ImageProcessing:
        """The processor saved in model directory ``path`` (``processor_config.json``)."""
        from transformers import AutoProcessor

        if not any(os.path.isfile(os.path.join(path, n)) for n in ("processor_config.json", "preprocessor_config.json")):
            raise ValueError(f"{path}: a vision model without its processor (processor_config.json)")
        raw = _config(path)
        if raw.get("model_type") in GRID_FAMILIES:
            return GridImageProcessing.load_grid(path, raw, image_token_id)
        proc = AutoProcessor.from_pretrained(path)
        token = getattr(proc, "image_token", None) or proc.tokenizer.convert_ids_to_tokens(image_token_id)
        return cls(proc, token, image_token_id)

    @classmethod
    def for_model(cls, path: str) -> ImageProcessing | None:
        """The processor of the vision-language model in directory ``path``; None for another model
        (a text-only one, a GGUF file)."""
        from .encoder import is_vision_config

        if not os.path.isfile(os.path.join(path, "config.json")):
            return None
        raw = _config(path)
        if not is_vision_config(raw):
            return None
        return cls.load(path, int(raw.get("image_token_id", raw.get("image_token_index"))))

    def image(self, img, param: str) -> tuple[np.ndarray, int, dict[str, np.ndarray]]:
        """One decoded image through the processor: its pixel values (float32), its token count, and
        the processor's other per-image outputs (a grid for Qwen2-VL)."""
        try:
            out = self.processor(text=self.image_token, images=[img], return_tensors="np")
        except Exception as e:  # the processor's own refusal (an image too small to patch, ...)
            raise ValidationError(f"image rejected by the model's processor ({str(e)[:120]})", param=param) from None
        ids = np.asarray(out["input_ids"]).reshape(-1)
        n = int((ids == self.image_token_id).sum())
        extra = {k: np.asarray(v) for k, v in out.items() if k not in NOT_PER_IMAGE}
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), n, extra

    def prepare(self, img, param: str) -> PreparedImage:
        """One decoded image through the processor, and its content digest (a 400 naming ``param``
        if the processor refuses it). Thread-safe: the front runs it in a pool."""
        pixels, n, extra = self.image(img, param)
        return PreparedImage(pixels, n, extra, content_digest(pixels, extra))

    def expand(self, ids: list[int], images: list, params: list[str]) -> tuple[list[int], MultiModalInputs]:
        """``ids`` with each placeholder token repeated for its image (``images[k]`` for the k-th
        placeholder: a decoded image, or one already ``prepare``d; ``params[k]`` names its part in a
        400), and where each image's run is."""
        marks = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(marks) != len(images):
            raise ValidationError(
                f"the prompt has {len(marks)} image placeholders for {len(images)} images",
                param=params[0] if params else "image_data",
            )
        out: list[int] = []
        items: list[ImageItem] = []
        prev = 0
        for pos, img, param in zip(marks, images, params):
            p = img if isinstance(img, PreparedImage) else self.prepare(img, param)
            out.extend(ids[prev:pos])
            items.append(ImageItem(len(out), p.length, p.digest, p.pixels, p.extra))
            out.extend([self.image_token_id] * p.length)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, MultiModalInputs(tuple(items))


# The processor's outputs that are not the image's: the prompt's (``mm_token_type_ids`` marks its
# image tokens) and the pixels (hashed by name first).
NOT_PER_IMAGE = ("input_ids", "attention_mask", "pixel_values", "mm_token_type_ids")


class GridImageProcessing(ImageProcessing):
    """Qwen2-VL's and Qwen2.5-VL's: dynamic resolution, the image processor
    (``Qwen2VLImageProcessorPil``, Pillow) resizes each image to a multiple of the patch x merge size
    and gives its patches and their grid (``image_grid_thw``); the image's token count is the grid's
    product over ``merge_size**2``, as the family's ``Qwen2VLProcessor.replace_image_token`` counts
    them. (That processor class needs a video processor, hence torchvision: its image processor and
    the tokenizer are used alone.)"""

    @classmethod
    def load_grid(cls, path: str, raw: dict, image_token_id: int) -> GridImageProcessing:
        from transformers import AutoImageProcessor, AutoTokenizer

        images = AutoImageProcessor.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        token = tok.convert_ids_to_tokens(image_token_id)
        marks = [raw.get(k) for k in ("vision_start_token_id", "vision_end_token_id")]
        wrap = "" if None in marks else "{}" + token + "{}"
        return cls(images, token, image_token_id, wrap.format(*tok.convert_ids_to_tokens(marks)) if wrap else None)

    def image(self, img, param: str) -> tuple[np.ndarray, int, dict[str, np.ndarray]]:
        try:
            out = self.processor(images=[img], return_tensors="np")
        except Exception as e:
            raise ValidationError(f"image rejected by the model's processor ({str(e)[:120]})", param=param) from None
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(1, 3)
        n = int(grid.prod()) // int(self.processor.merge_size) ** 2
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), n, {"image_grid_thw": grid}


def _config(path: str) -> dict:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def content_digest(pixels: np.ndarray, extra: dict[str, np.ndarray]) -> bytes:
    """A hash of what the encoder reads of an image: its processed pixels (and shape) and the
    processor's other outputs. The same picture in two encodings that decode alike hashes alike."""
    h = hashlib.blake2b(digest_size=32, person=b"kvledger-image")
    for name, a in (("pixel_values", pixels), *sorted(extra.items())):
        h.update(name.encode() + repr((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()
