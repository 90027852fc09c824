"""The family's own image preprocessing: transformers' processor saved beside the model
(``AutoProcessor``) resizes and normalises each image and says how many placeholder tokens it
takes; nothing of its arithmetic is copied here.

``ImageProcessing.expand`` turns a prompt whose image placeholders are one token each (the chat
template's ``<image>``) into the prompt the model reads — each placeholder repeated as many times
as its image has tokens — and the ``MultiModalInputs`` that say where each image's run is."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from ..errors import ValidationError
from .inputs import ImageItem, MultiModalInputs


class ImageProcessing:
    """One model's image processor and its placeholder token."""

    def __init__(self, processor: Any, image_token: str, image_token_id: int):
        self.processor = processor
        self.image_token = image_token
        self.image_token_id = image_token_id

    @classmethod
    def load(cls, path: str, image_token_id: int) -> ImageProcessing:
        """The processor saved in model directory ``path`` (``processor_config.json``)."""
        from transformers import AutoProcessor

        if not any(os.path.isfile(os.path.join(path, n)) for n in ("processor_config.json", "preprocessor_config.json")):
            raise ValueError(f"{path}: a vision model without its processor (processor_config.json)")
        proc = AutoProcessor.from_pretrained(path)
        token = getattr(proc, "image_token", None) or proc.tokenizer.convert_ids_to_tokens(image_token_id)
        return cls(proc, token, image_token_id)

    @classmethod
    def for_model(cls, path: str) -> ImageProcessing | None:
        """The processor of the vision-language model in directory ``path``; None for another model
        (a text-only one, a GGUF file)."""
        import json

        from .encoder import is_vision_config

        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            return None
        with open(cfg) as f:
            raw = json.load(f)
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
        extra = {k: np.asarray(v) for k, v in out.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32), n, extra

    def expand(self, ids: list[int], images: list, params: list[str]) -> tuple[list[int], MultiModalInputs]:
        """``ids`` with each placeholder token repeated for its image (``images[k]`` for the k-th
        placeholder; ``params[k]`` names its part in a 400), and where each image's run is."""
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
            pixels, n, extra = self.image(img, param)
            out.extend(ids[prev:pos])
            items.append(ImageItem(len(out), n, content_digest(pixels, extra), pixels, extra))
            out.extend([self.image_token_id] * n)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, MultiModalInputs(tuple(items))


def content_digest(pixels: np.ndarray, extra: dict[str, np.ndarray]) -> bytes:
    """A hash of what the encoder reads of an image: its processed pixels (and shape) and the
    processor's other outputs. The same picture in two encodings that decode alike hashes alike."""
    h = hashlib.blake2b(digest_size=32, person=b"kvledger-image")
    for name, a in (("pixel_values", pixels), *sorted(extra.items())):
        h.update(name.encode() + repr((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()
