"""A request's images as the engine sees them: each image's run of placeholder tokens in the prompt
(``offset``, ``length``), its pixel values (float32, the family processor's), and a hash of its
content, which keys the run's pages in the prefix cache (``memory/cache_key.py``: the placeholder
tokens all have the same id, so two different images would otherwise share KV)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..common.messages import WireImage
from ..errors import ValidationError

if TYPE_CHECKING:
    from .mrope import MRope


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image: placeholder tokens ``[offset, offset + length)`` of the prompt."""

    offset: int
    length: int
    digest: bytes  # blake2b of the decoded pixels and the processor's output shape (``processor.py``)
    pixel_values: np.ndarray  # float32, as the family's processor gave it for this image alone
    # The processor's other per-image outputs the encoder needs (Qwen2-VL's grid), by name.
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class MultiModalInputs:
    """The images of one prompt, in prompt order, their runs disjoint. ``rope``: the prompt's M-RoPE
    layout where the model's decoder takes three positions a token (Qwen2-VL: ``mrope.py``), set by
    the engine when it makes the request; None: a token's position is its index."""

    images: tuple[ImageItem, ...]
    rope: MRope | None = None

    def __post_init__(self) -> None:
        end = 0
        for im in self.images:
            if im.offset < end or im.length <= 0:
                raise ValueError("image token runs must be ordered, disjoint and non-empty")
            end = im.end

    def overlapping(self, start: int, stop: int) -> list[tuple[int, ImageItem]]:
        """The images (with their index) whose run meets prompt positions ``[start, stop)``."""
        return [(i, im) for i, im in enumerate(self.images) if im.offset < stop and im.end > start]

    @property
    def num_image_tokens(self) -> int:
        return sum(im.length for im in self.images)


def to_wire(mm: MultiModalInputs) -> list[WireImage]:
    """The images as they cross to the engine process: pixels as float32 bytes, the processor's
    other outputs (Qwen2-VL's grid: integers) as (shape, values)."""
    out = []
    for im in mm.images:
        px = np.ascontiguousarray(im.pixel_values, dtype=np.float32)
        extra = {}
        for name, a in im.extra.items():
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"processor output {name} is not integer: it does not cross to the engine")
            extra[name] = (list(a.shape), [int(x) for x in a.reshape(-1)])
        out.append(WireImage(im.offset, im.length, im.digest, px.tobytes(), list(px.shape), extra))
    return out


def from_wire(images: list[WireImage]) -> MultiModalInputs:
    """The engine's side of ``to_wire`` (a malformed image: a 400)."""
    try:
        items = [
            ImageItem(
                w.offset, w.length, w.digest, np.frombuffer(w.pixels, dtype=np.float32).reshape(w.shape),
                {k: np.asarray(v, dtype=np.int64).reshape(shape) for k, (shape, v) in w.extra.items()},
            )
            for w in images
        ]
        return MultiModalInputs(tuple(items))
    except ValueError as e:
        raise ValidationError(f"malformed images ({e})", param="image_data") from None
