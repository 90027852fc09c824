"""The scheduler's side of a request's images: which chunk feeds which image tokens, and whose
encoded embeddings the runner holds between chunks (the ledger's ``image embeds`` state).

An image's embeddings are encoded by the runner when a chunk first feeds one of its tokens and the
runner holds none for it (``ImageFeed.item`` set); when that chunk does not reach the image's last
token (chunked prefill split it), the runner keeps them under the feed's key, owned by the request,
until the chunk that feeds the last token. A request that ends or is retracted while it owns some
gives them back on the one release path (a release hook; ``retract``): their keys go to the runner
with the next step (``SchedulerOutput.image_drops``), before it runs.

| state (per image of a live request) | who holds its embeddings |
|---|---|
| not begun, or fully prefilled | nobody |
| encoded: tokens fed, its last one not yet | the runner, owned by the request (``held``) |

A streaming session keeps the images of its history (their pixels, not their embeddings: the KV
holds what they made) so that a turn that recomputes the history encodes them again; they are the
session's, committed with the turn that sent them and gone with the session (``Session.images``,
reported here as ``session_image_bytes``).
"""

from __future__ import annotations

from .output import ImageFeed
from .request import Req


class ImageBooks:
    """Which image embeddings the runner holds, by key, with their owner and size in tokens."""

    def __init__(self, sessions=None) -> None:
        self.sessions = sessions  # memory.SessionKV: the sessions' images are in the figures and audit
        self.held: dict[str, tuple[str, int]] = {}  # key -> (owner rid, tokens)
        self._drops: list[str] = []
        self.used = False  # a request with images was ever fed (the figure shows from then on)

    @staticmethod
    def key(req: Req, i: int) -> str:
        return f"{req.rid}#{req.admitted_seq}#{i}"

    def feeds(self, req: Req, a: int, b: int) -> list[ImageFeed] | None:
        """The images chunk ``[a, b)`` of ``req`` feeds, and what the runner holds after it."""
        if req.mm is None:
            return None
        self.used = True
        out = []
        for i, im in req.mm.overlapping(a, min(b, len(req.input_ids))):
            key = self.key(req, i)
            lo, hi = max(a, im.offset), min(b, im.end)
            held = key in self.held
            last = hi == im.end
            out.append(ImageFeed(key, lo - a, lo - im.offset, hi - lo, None if held else im, last))
            if last:
                self.held.pop(key, None)
            elif not held:
                self.held[key] = (req.rid, im.length)
        return out or None

    def release(self, req: Req) -> None:
        """``req`` ended or was retracted: the embeddings it owns are dropped with the next step."""
        if req.mm is None:
            return
        for key in [k for k, (rid, _) in self.held.items() if rid == req.rid]:
            del self.held[key]
            self._drops.append(key)

    @property
    def has_drops(self) -> bool:
        return bool(self._drops)

    def audit(self, report, holdings) -> None:
        """The ledger's audit: every held image's owner is a live request that holds memory."""
        live = {h.owner.split(" [")[0] for h in holdings}
        for key, (rid, _) in self.held.items():
            if f"req {rid}" not in live:
                report.problems.append(f"image embeds {key}: owner req {rid} holds no memory (not live)")
        for s in self.sessions.by_id.values() if self.sessions is not None else ():
            if s.images and s.images[-1].end > len(s.tokens):
                report.problems.append(f"{s.owner}: an image's tokens end past its {len(s.tokens)} tokens")

    def figures(self) -> dict[str, int]:
        """The ledger's image figures: embeddings held between chunks (tokens), sessions' images (bytes)."""
        out = {"image_embed_tokens": self.held_tokens}
        if self.sessions is not None:
            out["session_image_bytes"] = self.sessions.image_bytes()
        return out

    def take_drops(self) -> list[str]:
        drops, self._drops = self._drops, []
        return drops

    @property
    def held_tokens(self) -> int:
        return sum(n for _, n in self.held.values())
