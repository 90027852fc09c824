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

The encoder-output cache (``EncoderCacheBooks``, ``--encoder-cache-bytes``; 0: off) keeps images'
embeddings across requests, keyed by the image's content digest, owned by the cache itself (the
ledger's ``encoder cache`` state): a request that feeds an image the cache holds is not encoded
again (another question about the same picture, behind other text, where the prefix cache cannot
help). An entry is put when a chunk first sends the image to the runner (``ImageFeed.cache_key``,
``store``), evicted least recently used past the byte budget — never an entry a feed of the same
step reads — and its eviction is a drop like a request's (``image_drops``). It is not a request's
holding: an aborted request leaves its image in the cache as any other, within the budget.

A streaming session keeps the images of its history (their pixels, not their embeddings: the KV
holds what they made) so that a turn that recomputes the history encodes them again; they are the
session's, committed with the turn that sent them and gone with the session (``Session.images``,
reported here as ``session_image_bytes``).
"""

from __future__ import annotations

from collections import OrderedDict

from .output import ImageFeed
from .request import Req


class EncoderCacheBooks:
    """The encoder-output cache's entries (key -> bytes) in LRU order, within ``budget`` bytes."""

    OWNER = "encoder cache"

    def __init__(self, budget: int, bytes_per_token: int):
        self.budget = budget
        self.bytes_per_token = bytes_per_token
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0
        self.hits = 0  # feeds that read the cache instead of encoding
        self.misses = 0
        self.evictions = 0
        self._step: set[str] = set()  # entries the step being built reads or puts (not evictable)

    @staticmethod
    def key(digest: bytes) -> str:
        return "enc:" + digest.hex()

    def lookup(self, key: str) -> bool:
        """Whether the cache holds ``key`` (then most recently used, and safe for this step)."""
        if key not in self.entries:
            self.misses += 1
            return False
        self.entries.move_to_end(key)
        self._step.add(key)
        self.hits += 1
        return True

    def put(self, key: str, tokens: int, drops: list[str]) -> bool:
        """Make room for ``key`` (evicted keys appended to ``drops``) and book it; False when it
        cannot fit (larger than the budget, or the rest is read by this step)."""
        size = tokens * self.bytes_per_token
        if size > self.budget:
            return False
        victims, freed = [], 0
        for k, n in self.entries.items():
            if self.bytes - freed + size <= self.budget:
                break
            if k not in self._step:
                victims.append(k)
                freed += n
        if self.bytes - freed + size > self.budget:
            return False
        for k in victims:
            self.bytes -= self.entries.pop(k)
            self.evictions += 1
            drops.append(k)
        self.entries[key] = size
        self.bytes += size
        self._step.add(key)
        return True

    def end_step(self) -> None:
        self._step.clear()

    def clear(self, drops: list[str]) -> None:
        drops.extend(self.entries)
        self.entries.clear()
        self.bytes = 0

    def audit(self, report) -> None:
        total = sum(self.entries.values())
        if total != self.bytes or total > self.budget or any(n <= 0 for n in self.entries.values()):
            report.problems.append(
                f"{self.OWNER}: entries hold {total} bytes, books say {self.bytes}, budget {self.budget}"
            )

    def figures(self) -> dict[str, int]:
        return {
            "encoder_cache_bytes": self.bytes,
            "encoder_cache_entries": len(self.entries),
            "encoder_cache_budget_bytes": self.budget,
        }


class ImageBooks:
    """Which image embeddings the runner holds, by key, with their owner and size in tokens."""

    def __init__(self, sessions=None, cache: EncoderCacheBooks | None = None) -> None:
        self.sessions = sessions  # memory.SessionKV: the sessions' images are in the figures and audit
        self.held: dict[str, tuple[str, int]] = {}  # key -> (owner rid, tokens)
        self._drops: list[str] = []
        self.used = False  # a request with images was ever fed (the figure shows from then on)
        self.cache = cache if cache is not None and cache.budget > 0 else None

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
            feed = ImageFeed(key, lo - a, lo - im.offset, hi - lo, None if held else im, last)
            if not held and self.cache is not None:  # read from the cache, or put there once encoded
                feed.cache_key = EncoderCacheBooks.key(im.digest)
                feed.store = not self.cache.lookup(feed.cache_key) and self.cache.put(
                    feed.cache_key, im.length, self._drops
                )
            out.append(feed)
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
        """The ledger's audit: every held image's owner is a live request that holds memory; the
        encoder cache's entries add up and fit its budget."""
        live = {h.owner.split(" [")[0] for h in holdings}
        for key, (rid, _) in self.held.items():
            if f"req {rid}" not in live:
                report.problems.append(f"image embeds {key}: owner req {rid} holds no memory (not live)")
        for s in self.sessions.by_id.values() if self.sessions is not None else ():
            if s.images and s.images[-1].end > len(s.tokens):
                report.problems.append(f"{s.owner}: an image's tokens end past its {len(s.tokens)} tokens")
        if self.cache is not None:
            self.cache.audit(report)

    def flush_cache(self) -> None:
        """``/flush_cache``: the encoder cache's entries dropped with the next step."""
        if self.cache is not None:
            self.cache.clear(self._drops)

    def figures(self) -> dict[str, int]:
        """The ledger's image figures: embeddings held between chunks (tokens), sessions' images
        (bytes), the encoder cache's bytes."""
        out = {"image_embed_tokens": self.held_tokens}
        if self.sessions is not None:
            out["session_image_bytes"] = self.sessions.image_bytes()
        if self.cache is not None:
            out.update(self.cache.figures())
        return out

    def take_drops(self) -> list[str]:
        """The keys the runner drops before the step just built runs (its feeds read none of them)."""
        if self.cache is not None:
            self.cache.end_step()
        drops, self._drops = self._drops, []
        return drops

    @property
    def held_tokens(self) -> int:
        return sum(n for _, n in self.held.values())
