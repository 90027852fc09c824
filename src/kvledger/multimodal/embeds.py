"""The runner's side of image embeddings: encoded when a chunk first feeds an image's tokens, kept
between chunks under the scheduler's key (``scheduler/images.py`` keeps the books of who owns
them), and spliced into the forward at the image tokens' flat positions."""

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
    """Encoded images held between chunks, by key."""

    def __init__(self, encoder: VisionEncoder):
        self.encoder = encoder
        self.held: dict[str, torch.Tensor] = {}
        self.encoded = 0  # images encoded (a figure for tests and the bench)

    def drop(self, keys: list[str]) -> None:
        for k in keys:
            self.held.pop(k, None)

    def splice(self, reqs, starts: list[int]) -> Splice | None:
        """The splice of a step's rows (``ScheduledReq``s, each starting at flat position
        ``starts[i]``); encodes the images no embeddings are held for, keeps those a later chunk reads."""
        index: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for r, t0 in zip(reqs, starts):
            for f in r.images or ():
                emb = self.held.get(f.key)
                if emb is None:
                    if f.item is None:
                        raise RuntimeError(f"image embeddings {f.key} are neither held nor sent")
                    emb = self.encoder.encode(f.item)
                    self.encoded += 1
                if f.last:
                    self.held.pop(f.key, None)
                else:
                    self.held[f.key] = emb
                index.append(torch.arange(t0 + f.at, t0 + f.at + f.count))
                rows.append(emb[f.first : f.first + f.count])
        if not index:
            return None
        return Splice(torch.cat(index), torch.cat(rows))
