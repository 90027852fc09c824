"""A request's key in the prefix cache: its tokens, with the first page salted when it carries a cache
salt (vLLM's ``cache_salt``) or runs with a LoRA adapter, so that requests with different salts or
adapters never share cached KV and requests with the same ones do.

Every lookup and insertion starts at the root with the first page, so salting that page alone puts
each salt's KV in a subtree of its own: the radix tree (L1 and L2) and the file tier's keys (chained
from the first page) need no other change. A salted page's ids are negative 62-bit keyed hashes of
(salt, position, token): they never equal a real token id (>= 0), still fit an int64 (the file
tier packs keys as int64), and two salts collide on a page only with probability 2**-62 per id.

An image's placeholder tokens all have one id, so a prompt's image runs are keyed by the image's
content instead (``images``: the request's ``multimodal.ImageItem``s): token j of an image is a
negative keyed hash of (the image's digest, j). The same image at the same place reuses its KV; two
different images never share it, and the pages after an image are keyed by everything before them
(the radix tree's path), images included.

An adapter's namespace is its files' fingerprint (``model/lora.py``), hashed with the salt under a
personalisation of its own: no ``cache_salt`` a client can send reproduces an adapter's key, an
adapter reloaded from the same files finds its KV again, and different files under one name do not.
"""

from __future__ import annotations

import functools
import hashlib


def _salt_key(salt: str) -> bytes:
    return hashlib.blake2b(salt.encode(), digest_size=32, person=b"kvledger-salt").digest()


def _lora_key(adapter: str, salt: str | None) -> bytes:
    a, s = adapter.encode(), (salt or "").encode()
    # Length-prefixed: the pair (adapter, salt) is unambiguous.
    return hashlib.blake2b(len(a).to_bytes(4, "little") + a + s, digest_size=32, person=b"kvledger-lora").digest()


@functools.lru_cache(maxsize=1024)
def _image_key(digest: bytes, length: int) -> tuple[int, ...]:
    """The keys of an image's ``length`` placeholder tokens (computed once per image)."""
    out = []
    for j in range(length):
        h = hashlib.blake2b(j.to_bytes(4, "little"), digest_size=8, key=digest, person=b"kvledger-image")
        out.append(-1 - (int.from_bytes(h.digest(), "little") >> 2))
    return tuple(out)


def cache_key(
    tokens: list[int], salt: str | None, page_size: int, adapter: str | None = None, images=None
) -> list[int]:
    """``tokens`` as the prefix cache sees them (unchanged without a salt, adapter or images, or
    shorter than a page: nothing shorter than a page is ever matched or cached). ``images``: the
    prompt's ``ImageItem``s (``offset``, ``length``, ``digest``)."""
    if images:
        tokens = list(tokens)
        for im in images:
            if im.offset >= len(tokens):
                break
            keys = _image_key(im.digest, im.length)
            n = min(im.length, len(tokens) - im.offset)
            tokens[im.offset : im.offset + n] = keys[:n]
    if (salt is None and adapter is None) or len(tokens) < page_size:
        return tokens
    key = _salt_key(salt) if adapter is None else _lora_key(adapter, salt)
    first = []
    for i, t in enumerate(tokens[:page_size]):
        # (signed: an image token's key is negative; a token id's bytes are as before)
        h = hashlib.blake2b(i.to_bytes(4, "little") + t.to_bytes(8, "little", signed=True), digest_size=8, key=key)
        first.append(-1 - (int.from_bytes(h.digest(), "little") >> 2))
    return first + tokens[page_size:]
