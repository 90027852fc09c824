"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): each token's rotary position is three numbers
(temporal, height, width), which the decoder's rotary turns in separate sections of its frequencies
(``mrope_section``). A text token's three are equal; an image's tokens take their place in the
image's merged patch grid, offset by where the image starts; the text after an image continues from
the image's start plus ``max(grid height, grid width)``, so after an image a token's rope position
is no longer its index in the sequence: it is the index plus the request's offset (``delta``), the
sum over the images before it of (positions the image spans - tokens it has), negative or zero.

The layout is a function of the prompt's images alone (where each starts, its merged grid), so any
token's positions follow from its index: a prefill chunk that starts inside or after an image, a
prefix-cache hit that ends inside one, a retracted request's re-prefill and every decode step get
the positions transformers' ``get_rope_index`` gives the whole sequence. The request carries it
(``MultiModalInputs.rope``, built by the engine at ``make_request``); the scheduler gives each row
its share (``ScheduledReq.rope_delta`` for a chunk that meets no image, ``ScheduledReq.mrope``'s
three rows for one that does), and the runner builds the forward's positions from them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ValidationError


@dataclass(frozen=True)
class ImageGrid:
    """One image's run of placeholder tokens ``[offset, offset + t*h*w)`` and its merged grid."""

    offset: int
    t: int
    h: int
    w: int
    shift: int  # the offset before the image (the sum of the earlier images' span - tokens)

    @property
    def length(self) -> int:
        return self.t * self.h * self.w

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def span(self) -> int:
        """The rope positions the image takes in the text's sequence (transformers' ``max(h, w)``)."""
        return max(self.h, self.w)


@dataclass(frozen=True)
class MRope:
    """A prompt's M-RoPE layout: its images' grids in prompt order."""

    grids: tuple[ImageGrid, ...]

    @classmethod
    def of(cls, images, merge: int) -> MRope:
        """The layout of ``images`` (``ImageItem``s whose ``extra["image_grid_thw"]`` is the
        processor's patch grid), ``merge`` the vision tower's spatial merge size; a 400 where an
        image's grid does not give its token count."""
        grids, shift = [], 0
        for k, im in enumerate(images):
            thw = im.extra.get("image_grid_thw")
            if thw is None or np.asarray(thw).size != 3:
                raise ValidationError("an image without its patch grid (image_grid_thw)", param=f"image_data[{k}]")
            t, h, w = (int(x) for x in np.asarray(thw).reshape(3))
            if h % merge or w % merge or t * (h // merge) * (w // merge) != im.length:
                raise ValidationError(f"image grid {t}x{h}x{w} does not give its {im.length} tokens",
                                      param=f"image_data[{k}]")  # fmt: skip
            g = ImageGrid(im.offset, t, h // merge, w // merge, shift)
            grids.append(g)
            shift += g.span - g.length
        return cls(tuple(grids))

    @property
    def delta(self) -> int:
        """The offset of every token after the last image (the decode steps')."""
        return self.shift_at(1 << 62)

    def shift_at(self, i: int) -> int:
        """The offset of a text token at index ``i`` (the images that end at or before it)."""
        s = 0
        for g in self.grids:
            if g.end > i:
                break
            s = g.shift + g.span - g.length
        return s

    def chunk(self, a: int, b: int) -> tuple[int, np.ndarray | None]:
        """Tokens ``[a, b)``: (their offset, None) where they meet no image, else (0, their
        positions ``[3, b - a]`` int64)."""
        met = [g for g in self.grids if g.offset < b and g.end > a]
        if not met:
            return self.shift_at(a), None
        idx = np.arange(a, b, dtype=np.int64)
        shift = np.zeros(b - a, dtype=np.int64)
        for g in self.grids:  # each text token: the shift of the images that end at or before it
            shift[idx >= g.end] = g.shift + g.span - g.length
        pos = np.repeat((idx + shift)[None, :], 3, axis=0)
        for g in met:
            lo, hi = max(a, g.offset), min(b, g.end)
            j = np.arange(lo - g.offset, hi - g.offset, dtype=np.int64)  # the tokens' index in the image
            start = g.offset + g.shift
            hw = g.h * g.w
            pos[0, lo - a : hi - a] = start + j // hw
            pos[1, lo - a : hi - a] = start + (j % hw) // g.w
            pos[2, lo - a : hi - a] = start + j % g.w
        return 0, pos
