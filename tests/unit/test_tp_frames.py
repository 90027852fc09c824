"""The tensor-parallel wire (parallel/frames.py, issue 50 item 8): a step crosses whole and typed; a
frame that is not exactly the expected type (a pickle, garbage, another frame, an array whose shape
lies about its bytes, a length past the limit) is refused with ``FrameError`` and nothing in it runs."""

from __future__ import annotations

import dataclasses
import os
import pickle

import msgspec
import numpy as np
import pytest
import torch

from kvledger.common.sampling import SamplingParams, SamplingRow
from kvledger.disagg.tp import PDMeta
from kvledger.hicache.ops import Cancel, HiCacheMeta, Load, Read, Restore, Save, Store
from kvledger.memory import PageWrite
from kvledger.memory.sparse_kv import SparseBegin, SparseStep
from kvledger.parallel import frames
from kvledger.parallel.errors import FrameError, TPGroupBroken
from kvledger.scheduler.output import ScheduledReq, SchedulerOutput


def rich_step() -> SchedulerOutput:
    """A step with every kind of field set: sampling with penalties' histories, a structured-output
    bitmask, prompt logprobs, pooling, drafts; the hierarchical cache's and PD's metadata together (a
    MultiConnector's tuple, with a None); HiSparse's copies."""
    sampling = SamplingRow(SamplingParams(max_new_tokens=9, temperature=0.5, stop=["\n"], seed=7,
                                          repetition_penalty=1.1), 3, [1, 2], [5])  # fmt: skip
    mask = np.arange(8, dtype=np.int32).reshape(2, 4) - 3
    reqs = [
        ScheduledReq("a", 0, 0, [1, 2, 3, 4], 1, sampling, mask, [2, 3], 1, 2, 0, [11, 12], None, -3),
        ScheduledReq("b", 5, 16, [9], 0, None),
    ]
    hicache = HiCacheMeta([Save([1, 2], [7, 8]), Restore([7], [3]), Store(4, [1, 2, 3], [9]),
                           Read(5, [1, 2, 3], 1, [10]), Cancel(5)], [Load("a", [7], [3])], True)  # fmt: skip
    pd = PDMeta(2, collect=[torch.arange(5, dtype=torch.long) * 3], place=[torch.tensor([4, 2], dtype=torch.long)])
    sparse = SparseStep([3], [SparseBegin(1, [2, 3], [4, 5], [6], 30, None)], [1])
    return SchedulerOutput(reqs, [PageWrite(0, 0, [4, 5]), PageWrite(5, 1, [6])], (hicache, pd, None), sparse, 41)


def test_the_step_frame_carries_every_field_of_the_scheduler_output():
    assert [f.name for f in dataclasses.fields(SchedulerOutput)] == list(frames.Step.__struct_fields__)


def test_a_step_crosses_whole_and_typed():
    sent = rich_step()
    got = frames.decode(frames.encode(frames.Step.of(sent)), frames.ToWorker).scheduler_output()
    assert isinstance(got, SchedulerOutput) and got.step == 41 and got.page_writes == sent.page_writes
    for a, b in zip(got.reqs, sent.reqs, strict=True):
        for f in dataclasses.fields(ScheduledReq):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y) and x.flags.writeable
            else:
                assert x == y, f.name
    assert isinstance(got.reqs[0].sampling.params, SamplingParams)
    hicache, pd, none = got.connector_meta
    assert hicache == sent.connector_meta[0] and [type(op) for op in hicache.ops] == [Save, Restore, Store, Read, Cancel]
    assert none is None and pd.kv_heads == 2
    for x, y in zip(pd.collect + pd.place, sent.connector_meta[1].collect + sent.connector_meta[1].place, strict=True):
        assert x.dtype == torch.long and torch.equal(x, y)
    assert got.hisparse == sent.hisparse
    for kind, frame in ((frames.CommSetup, frames.CommSetup("/dev/shm/x", 7)), (frames.CommSetup, frames.CommSetup()),
                        (frames.Setup, frames.Setup(10, 20)), (frames.ToWorker, frames.Stop()),
                        (frames.ToWorker, frames.StatsQuery()), (frames.Stats, frames.Stats(1, {"graphs": 2}))):  # fmt: skip
        assert frames.decode(frames.encode(frame), kind) == frame


class Plant:
    """A pickle whose loading creates a file: what ``broadcast_object_list`` would have run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_frames_are_refused_and_nothing_in_them_runs(tmp_path):
    planted = str(tmp_path / "planted")
    evil = pickle.dumps(Plant(planted))
    pickle.loads(pickle.dumps(Plant(str(tmp_path / "proof")))).close()  # the payload does work when unpickled
    assert os.path.exists(tmp_path / "proof")
    step = frames.encode(frames.Step.of(rich_step()))
    bad_array = frames.Array("int64", [3], b"\0" * 8)  # 3 int64s need 24 bytes
    crafted = {
        "a pickle": (evil, frames.ToWorker),
        "a pickle, as the setup": (evil, frames.Setup),
        "garbage": (os.urandom(64), frames.ToWorker),
        "empty": (b"", frames.ToWorker),
        "a truncated step": (bytes(step[:-5]), frames.ToWorker),
        "a step and trailing bytes": (bytes(step) + b"\x00", frames.ToWorker),
        "another frame (a stop where the setup is due)": (frames.encode(frames.Stop()), frames.Setup),
        "another frame (the pool's setup where the communicator's is due)": (frames.encode(frames.Setup(1, 2)), frames.CommSetup),
        "another frame (the setup in the step loop)": (frames.encode(frames.Setup(1, 2)), frames.ToWorker),
        "an unknown tag": (msgspec.msgpack.encode({"type": "exec", "code": "print(1)"}), frames.ToWorker),
        "a stats frame with a string count": (
            msgspec.msgpack.encode({"type": "stats", "rank": 1, "counts": {"g": "x"}}), frames.Stats
        ),
        "an array whose shape lies": (_with_bitmask(bad_array), frames.ToWorker),
        "an object array": (_with_bitmask(["object", [1], b"\0" * 8]), frames.ToWorker),
        "a negative shape": (_with_bitmask(["int32", [-1], b""]), frames.ToWorker),
    }
    for what, (data, kind) in crafted.items():
        with pytest.raises(FrameError):
            frames.decode(data, kind)
            pytest.fail(what)
    assert not os.path.exists(planted)
    assert issubclass(FrameError, TPGroupBroken)  # a worker leaves, rank 0's engine restarts
    for n in (0, -1, frames.MAX_FRAME_BYTES + 1):  # a length prefix out of range: refused before allocating
        with pytest.raises(FrameError):
            frames._check_size(n)


def _with_bitmask(array) -> bytes:
    """A step whose one request's bitmask is ``array`` (a crafted ``Array`` or its raw list form)."""
    raw = msgspec.msgpack.decode(frames.encode(frames.Step.of(SchedulerOutput([ScheduledReq("r", 0, 0, [1])]))))
    raw["reqs"][0]["token_bitmask"] = array if isinstance(array, list) else [array.dtype, array.shape, array.data]
    return msgspec.msgpack.encode(raw)


def image_step(dtype: torch.dtype) -> SchedulerOutput:
    """A step feeding an image (its pixels in the feed), with the rows rank 0 encoded for it."""
    from kvledger.multimodal.embeds import Splice
    from kvledger.multimodal.inputs import ImageItem
    from kvledger.scheduler.output import ImageFeed

    item = ImageItem(2, 3, b"digest", np.ones((3, 4), dtype=np.float32))
    feed = ImageFeed("r:0", 2, 0, 3, item, True, "cache-key", True)
    req = ScheduledReq("r", 0, 0, [1, 2, 9, 9, 9], images=[feed], mrope=np.arange(15).reshape(3, 5))
    rows = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8).to(dtype) / 7
    return SchedulerOutput([req], image_drops=["q:0"], image_rows=Splice(torch.arange(2, 5), rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_step_with_images_crosses_with_its_rows_and_without_its_pixels(dtype):
    sent = image_step(dtype)
    got = frames.decode(frames.encode(frames.Step.of(sent)), frames.ToWorker).scheduler_output()
    assert torch.equal(got.image_rows.index, sent.image_rows.index)
    assert got.image_rows.rows.dtype == dtype and torch.equal(got.image_rows.rows, sent.image_rows.rows)
    (feed,) = got.reqs[0].images
    assert feed.item is None and (feed.key, feed.at, feed.count, feed.last) == ("r:0", 2, 3, True)
    assert sent.reqs[0].images[0].item is not None  # rank 0's own row keeps its pixels
    assert np.array_equal(got.reqs[0].mrope, sent.reqs[0].mrope) and got.image_drops == ["q:0"]
    with pytest.raises(ValueError, match="crosses with its image rows"):  # rank 0 encodes before it sends
        frames.Step.of(dataclasses.replace(sent, image_rows=None))
    raw = msgspec.msgpack.decode(frames.encode(frames.Step.of(sent)))
    for lie in ({"shape": [4, 8]}, {"dtype": "float64"}, {"index": ["int64", [2], b"\0" * 16]},
                {"index": ["int32", [3], b"\0" * 12]}):  # fmt: skip
        bad = dict(zip(("index", "dtype", "shape", "data"), raw["image_rows"], strict=True)) | lie
        with pytest.raises(FrameError):
            frames.decode(msgspec.msgpack.encode({**raw, "image_rows": list(bad.values())}), frames.ToWorker)


def test_connector_metadata_without_a_frame_is_refused_when_sent():
    with pytest.raises(TypeError, match="has no tensor-parallel frame"):
        frames.Step.of(SchedulerOutput(connector_meta={"any": "dict"}))


def test_a_worker_refuses_a_pickle_sent_over_the_group(tmp_path):
    """The same frame over a real group: a rank 0 holding the key sends a worker (``python -m
    kvledger.parallel.worker``) a length and a pickle where the setup is due, the way
    ``broadcast_object_list`` sent objects. The worker leaves with ``FrameError`` and the pickle never
    ran (before: the worker unpickled it, and the file appeared)."""
    import json
    import subprocess
    import sys

    import torch.distributed as dist

    from kvledger.config import EngineConfig
    from kvledger.parallel import rendezvous
    from kvledger.parallel.executor import join_group

    planted = tmp_path / "planted"
    evil = bytearray(pickle.dumps(Plant(str(planted))))
    key = os.urandom(32)
    listener = rendezvous.listen(None)
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    cfg = EngineConfig.from_flat(tp_size=2, dist_timeout_s=60)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVLEDGER_TP_CONFIG": json.dumps(cfg.flat()),
           **rendezvous.handoff_env(key)}  # fmt: skip
    worker = subprocess.Popen([sys.executable, "-m", "kvledger.parallel.worker", "1", addr, "INFO"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        join_group(cfg, 0, addr, key, listener)
        dist.broadcast(torch.tensor([len(evil)], dtype=torch.int64), src=0)
        dist.broadcast(torch.frombuffer(evil, dtype=torch.uint8), src=0)
        out, _ = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert worker.returncode == 1 and "FrameError" in out, out[-2000:]
    assert not planted.exists()
