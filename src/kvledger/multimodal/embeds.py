"""The runner's side of image embeddings: encoded when a chunk first feeds an image's tokens (every
image of a step in one batch), kept between chunks under the scheduler's key and in the encoder
cache under the image's content (``scheduler/images.py`` keeps the books of who owns them), and
spliced into the forward at the image tokens' flat positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .encoder import VisionEncoder


@dataclass
class Splice:
    """A forward's image rows: flat token positions and the embeddings that replace theirs."""

    index: torch.Tensor  # [n] int64
    rows: torch.Tensor  # [n, hidden]


class ImageEmbeds:
    """Encoded images held between chunks (``held``, by a request's key) and the encoder cache's
    entries (``cache``, by content: ``scheduler/images.py`` decides what it keeps and evicts)."""

    def __init__(self, encoder: VisionEncoder):
        self.encoder = encoder
        self.held: dict[str, torch.Tensor] = {}
        self.cache: dict[str, torch.Tensor] = {}
        self.encoded = 0  # images encoded (a figure for tests and the bench)
        self.cache_hits = 0  # images read from the encoder cache instead

    def drop(self, keys: list[str]) -> None:
        for k in keys:
            self.held.pop(k, None)
            self.cache.pop(k, None)

    def splice(self, reqs, starts: list[int]) -> Splice | None:
        """The splice of a step's rows (``ScheduledReq``s, each starting at flat position
        ``starts[i]``). Each feed's embeddings come from its request's hold, the encoder cache, or
        this step's encoding, in which every image the step needs is encoded at once (the same
        picture once; images of one pixel shape in one vision-tower call: ``encode_many``)."""
        feeds = [(t0, f) for r, t0 in zip(reqs, starts) for f in r.images or ()]
        if not feeds:
            return None
        found: list[torch.Tensor | int] = []  # a feed's embeddings, or its index in ``todo``
        todo: dict[bytes, int] = {}  # content digest -> index of the image to encode
        items = []
        for _, f in feeds:
            emb = self.held.get(f.key)
            if emb is None and f.cache_key is not None:
                emb = self.cache.get(f.cache_key)
                self.cache_hits += emb is not None
            if emb is None:
                if f.item is None:
                    raise RuntimeError(f"image embeddings {f.key} are neither held nor sent")
                if f.item.digest not in todo:
                    todo[f.item.digest] = len(items)
                    items.append(f.item)
                found.append(todo[f.item.digest])
            else:
                found.append(emb)
        encoded = self.encoder.encode_many(items) if items else []
        self.encoded += len(items)
        index: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for (t0, f), got in zip(feeds, found):
            emb = encoded[got] if isinstance(got, int) else got
            if f.store and f.cache_key is not None:
                self.cache[f.cache_key] = emb
            if f.last:
                self.held.pop(f.key, None)
            else:
                self.held[f.key] = emb
            index.append(torch.arange(t0 + f.at, t0 + f.at + f.count))
            rows.append(emb[f.first : f.first + f.count])
        return Splice(torch.cat(index), torch.cat(rows))
