"""The HTTP front's image work off its event loop (``server/image_parts.ImageReader``): each part
read, decoded and put through the processor in the reader's bounded thread pool while the loop runs
other work; at most the pool's bound at once; the first bad part (in part order) a 400 naming it, once
every part has ended; the same images as the inline path gives."""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import numpy as np
import pytest

from kvledger.errors import ValidationError
from kvledger.multimodal.media import MediaLimits
from kvledger.multimodal.processor import ImageProcessing, PreparedImage
from kvledger.server.image_parts import ChatImages, ImageReader, chat_image_parts, content_text
from tests.helpers import tiny_image


def png_url(seed: int) -> str:
    buf = io.BytesIO()
    tiny_image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Gated(ImageProcessing):
    """A processor stand-in whose ``prepare`` waits for ``gate`` and records its thread and how many
    ran at once; its output is the image's pixels as floats (one token a row)."""

    def __init__(self):
        super().__init__(None, "<image>", 9)
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.threads: set[str] = set()

    def prepare(self, img, param: str) -> PreparedImage:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            assert self.gate.wait(10)
            px = np.asarray(img, dtype=np.float32)
            return PreparedImage(px, px.shape[0], {}, param.encode())
        finally:
            with self.lock:
                self.running -= 1


def test_parts_are_read_in_the_pool_while_the_loop_runs_on():
    proc = Gated()
    reader = ImageReader(proc, MediaLimits(), threads=2)
    parts = [(png_url(k), f"messages[0].content[{k}]") for k in range(5)]

    async def main():
        reading = asyncio.ensure_future(reader.read_all(parts))
        ticks = 0
        while proc.running < 2:  # the loop keeps running while the pool works
            await asyncio.sleep(0.005)
            ticks += 1
        assert not reading.done() and ticks > 0
        proc.gate.set()
        return await reading

    try:
        got = asyncio.run(main())
    finally:
        reader.close()
    assert list(got) == [w for _, w in parts] and all(isinstance(p, PreparedImage) for p in got.values())
    assert proc.most == 2  # the bound: never more than the pool's threads at once
    assert proc.threads and all(t.startswith("kvledger-image") for t in proc.threads)


def test_the_first_bad_part_in_order_is_the_400():
    proc = Gated()
    proc.gate.set()
    reader = ImageReader(proc, MediaLimits(), threads=2)
    parts = [(png_url(1), "messages[0].content[0]"), ("data:image/png;base64,AAAA", "messages[0].content[1]"),
             ("ftp://x/y.png", "messages[1].content[0]")]  # fmt: skip
    try:
        with pytest.raises(ValidationError) as e:
            asyncio.run(reader.read_all(parts))
        assert e.value.param == "messages[0].content[1]"
        with pytest.raises(ValidationError) as e:  # /generate's items: bare base64 and the rest checked too
            asyncio.run(reader.read_all([(7, "image_data[0]")], native=True))
        assert e.value.param == "image_data[0]"
    finally:
        reader.close()


def test_prepared_parts_give_what_the_inline_path_gives(llava):
    proc = ImageProcessing.for_model(llava[0])
    content = [{"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": png_url(3)}},
               {"type": "image_url", "image_url": png_url(4)}]  # fmt: skip
    msgs = [type("M", (), {"content": content})()]
    parts = chat_image_parts(msgs, 8)
    assert [w for _, w in parts] == ["messages[0].content[1]", "messages[0].content[2]"]
    assert chat_image_parts(msgs, 1) == parts[:1]
    reader = ImageReader(proc, MediaLimits())
    try:
        prepared = asyncio.run(reader.read_all(parts))
    finally:
        reader.close()
    inline, ahead = ChatImages(), ChatImages(prepared=prepared)
    text = content_text(content, "messages[0].content", proc, MediaLimits(), 8, inline)
    assert content_text(content, "messages[0].content", proc, MediaLimits(), 8, ahead) == text
    assert all(isinstance(p, PreparedImage) for p in ahead.images)
    ids = [1, proc.image_token_id, 2, proc.image_token_id]
    (a, mm_a), (b, mm_b) = proc.expand(ids, inline.images, inline.params), proc.expand(ids, ahead.images, ahead.params)
    assert a == b
    for x, y in zip(mm_a.images, mm_b.images, strict=True):
        assert x.digest == y.digest and (x.offset, x.length) == (y.offset, y.length)
        assert np.array_equal(x.pixel_values, y.pixel_values)
