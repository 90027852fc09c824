"""The HTTP front's image work alone (``server/image_parts.ImageReader``), in-process: eight PNGs as
``bench/vision.py`` sends them (244x232, the ``small`` model's processor) read, decoded, processed and
hashed one after another (the old path, on the event loop), through the reader's thread pool (2 and 4
threads), and through a process pool of 2 (for comparison: whether the GIL bounds the threads).

    python bench/image_reader.py

Prints milliseconds: ``one`` image, and each way's time for the eight (median of 5)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.vision import SIZES
from tests.helpers import build_tiny_llava, tiny_image

from kvledger.multimodal.media import MediaLimits, decode_image, image_bytes
from kvledger.multimodal.processor import ImageProcessing
from kvledger.server.image_parts import ImageReader

LIMITS = MediaLimits()
PROC: ImageProcessing | None = None


def png_url(k: int) -> str:
    buf = io.BytesIO()
    tiny_image(k, (244, 232)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def one(url: str):
    return PROC.prepare(decode_image(image_bytes(url, "p", LIMITS, {}), "p", LIMITS), "p")


def _init(path: str) -> None:
    global PROC
    PROC = ImageProcessing.for_model(path)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    path = build_tiny_llava(os.path.join(tempfile.mkdtemp(), "llava"), **SIZES["small"])
    _init(path)
    urls = [png_url(k) for k in range(8)]
    parts = [(u, f"p{k}") for k, u in enumerate(urls)]
    for _ in range(2):
        [one(u) for u in urls]
    res = {"one": timed(lambda: one(urls[0])),
           "inline_8": statistics.median(timed(lambda: [one(u) for u in urls]) for _ in range(5))}  # fmt: skip
    for n in (2, 4):
        reader = ImageReader(PROC, LIMITS, threads=n)
        asyncio.run(reader.read_all(parts))
        res[f"threads{n}_8"] = statistics.median(
            timed(lambda r=reader: asyncio.run(r.read_all(parts))) for _ in range(5)
        )
        reader.close()
    with ProcessPoolExecutor(2, initializer=_init, initargs=(path,)) as pool:
        list(pool.map(one, urls))
        res["processes2_8"] = statistics.median(timed(lambda: list(pool.map(one, urls))) for _ in range(5))
    print({k: round(v * 1000, 1) for k, v in res.items()}, "ms")


if __name__ == "__main__":
    main()
