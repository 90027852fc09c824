"""Images in, timed: kvledger (a real server, the ``openai`` client) against transformers' ``generate``
on the same random LLaVA, in one run.

    python bench/vision.py [--size tiny|small] [--repeats 5] [--out bench/results/vision.json]

Rows (float32 both sides, every image a different one unless said so, so no prefix-cache hit):
- ``ttft_1``: one image request alone, ``max_tokens=1`` (its whole latency: the prefill and one token);
  the median of ``--repeats``.
- ``ttft_8``: eight image requests at once (kvledger: eight clients; transformers: one padded batch of
  eight, every row's first token at the batch's end); mean and max over the eight, median of repeats.
- ``same_image``: one request whose image was seen before behind different text (the prefix cache
  cannot reuse it; an encoder-output cache can), median of repeats.
- ``decode``: decode tok/s of a text-only stream (64 tokens), alone and with image requests arriving
  beside it (kvledger: 4 text streams while 8 clients send image requests back to back; transformers: a
  padded batch of 4 text + 4 image rows, (64 - 1) / (t(64 tokens) - t(1 token)) per row).
- ``encoder``: kvledger's vision-tower calls and images encoded over the run, from /get_server_info
  (when the server reports them).

``--size tiny`` is the tests' model (36 image tokens, 2 layers of 64); ``small`` a bigger one (CLIP
256 wide x 4 layers on 224x224 images in 14-pixel patches: 256 image tokens; Llama 512 x 4)."""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openai
import torch
from tests.helpers import build_tiny_llava, tiny_image
from tests.server_harness import Server

SIZES = {
    "tiny": {},
    "small": dict(
        image_size=224, patch=14,
        text=dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
        vision=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                    projection_dim=256),
    ),
}
QUESTION = "Describe what this picture shows, briefly: "
TEXT = "Tell me a long story about a lighthouse keeper and the sea."


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Images:
    """A new image for every request (seeds never reused), so no request hits the prefix cache."""

    def __init__(self, size: tuple[int, int]):
        self.size = size
        self.seed = 1000
        self.lock = threading.Lock()

    def next(self):
        with self.lock:
            self.seed += 1
            return tiny_image(self.seed, self.size)


def image_message(img, prefix: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": prefix},
                                         {"type": "image_url", "image_url": {"url": data_url(img)}}]}]  # fmt: skip


# -- kvledger ------------------------------------------------------------------------------------------------
def kv_latency(client, messages, max_tokens: int = 1) -> float:
    t0 = time.perf_counter()
    client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    return time.perf_counter() - t0


def kv_stream_rate(client, n: int = 64) -> float:
    """Decode tok/s of one text stream: tokens after the first over the time after the first."""
    first = last = None
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": TEXT}], max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    tokens = 0
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and first is None:
            first = now
        if chunk.choices:
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return (tokens - 1) / (last - first) if last and first and last > first else float("nan")


def run_kvledger(model: str, images: Images, repeats: int, log: str) -> dict:
    srv = Server(model, "--dtype", "float32", "--max-running-requests", "16", log_path=log)
    try:
        srv.wait_healthy()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
        for _ in range(2):  # warm-up (first forwards, allocator)
            kv_latency(c, image_message(images.next()))
        out: dict = {}
        out["ttft_1"] = statistics.median(kv_latency(c, image_message(images.next())) for _ in range(repeats))
        means, maxes = [], []
        with ThreadPoolExecutor(8) as pool:
            for _ in range(repeats):
                lat = list(pool.map(lambda _: kv_latency(c, image_message(images.next())), range(8)))
                means.append(statistics.mean(lat))
                maxes.append(max(lat))
        out["ttft_8_mean"], out["ttft_8_max"] = statistics.median(means), statistics.median(maxes)
        same = []
        for k in range(repeats):
            img = images.next()
            kv_latency(c, image_message(img, f"Question {k}: what is this? "))
            same.append(kv_latency(c, image_message(img, f"Another question {k}, about the same picture: ")))
        out["same_image"] = statistics.median(same)
        out["decode_alone"] = statistics.median(kv_stream_rate(c) for _ in range(3))
        stop = threading.Event()

        def images_beside() -> None:
            while not stop.is_set():
                kv_latency(c, image_message(images.next()))

        with ThreadPoolExecutor(12) as pool:
            senders = [pool.submit(images_beside) for _ in range(8)]
            time.sleep(0.5)
            rates = list(pool.map(lambda _: kv_stream_rate(c), range(4)))
            stop.set()
            for s in senders:
                s.result()
        out["decode_beside_images"] = statistics.mean(rates)
        info = srv.info()
        out["encoder"] = {k: v for k, v in (info.get("vision") or {}).items()}
        out["memory_image"] = {k: v for k, v in info["memory"].items() if "image" in k or "encoder" in k}
        return out
    finally:
        srv.stop()


# -- transformers --------------------------------------------------------------------------------------------
def run_transformers(model: str, images: Images, repeats: int) -> dict:
    import transformers

    proc = transformers.AutoProcessor.from_pretrained(model)
    proc.tokenizer.pad_token = proc.tokenizer.eos_token
    proc.tokenizer.padding_side = "left"
    ref = transformers.LlavaForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()

    def prompt(text: str, image: bool) -> str:
        return proc.tokenizer.apply_chat_template(
            [{"role": "user", "content": text + ("<image>" if image else "")}], add_generation_prompt=True,
            tokenize=False,
        )  # fmt: skip

    @torch.no_grad()
    def gen(texts: list[str], imgs: list, n: int) -> float:
        inputs = proc(text=texts, images=imgs or None, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        ref.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=proc.tokenizer.pad_token_id,
                     eos_token_id=None)  # fmt: skip
        return time.perf_counter() - t0

    img_prompt = prompt(QUESTION, True)
    gen([img_prompt], [images.next()], 1)  # warm-up
    out: dict = {}
    out["ttft_1"] = statistics.median(gen([img_prompt], [images.next()], 1) for _ in range(repeats))
    batch8 = statistics.median(gen([img_prompt] * 8, [images.next() for _ in range(8)], 1) for _ in range(repeats))
    out["ttft_8_mean"] = out["ttft_8_max"] = batch8  # every row's first token comes at the batch's end
    img = images.next()
    out["same_image"] = statistics.median(
        gen([prompt(f"Another question {k}, about the same picture: ", True)], [img], 1) for k in range(repeats)
    )
    text_prompt = prompt(TEXT, False)
    t64, t1 = gen([text_prompt], [], 64), gen([text_prompt], [], 1)
    out["decode_alone"] = 63 / (t64 - t1)
    mixed = [text_prompt] * 4 + [img_prompt] * 4
    imgs4 = [images.next() for _ in range(4)]
    t64, t1 = gen(mixed, imgs4, 64), gen(mixed, imgs4, 1)
    out["decode_beside_images"] = 63 / (t64 - t1)
    return out


def table(res: dict) -> str:
    rows = [
        ("TTFT, 1 image request (s)", "ttft_1"),
        ("TTFT, 8 concurrent image requests, mean (s)", "ttft_8_mean"),
        ("TTFT, 8 concurrent image requests, max (s)", "ttft_8_max"),
        ("TTFT, an image seen before behind other text (s)", "same_image"),
        ("decode tok/s of a text stream, alone", "decode_alone"),
        ("decode tok/s of a text stream beside image requests", "decode_beside_images"),
    ]
    lines = ["| row | kvledger | transformers |", "|---|---|---|"]
    for name, key in rows:
        a, b = res["kvledger"].get(key), res["transformers"].get(key)
        lines.append(f"| {name} | {a:.3f} | {b:.3f} |" if "tok/s" not in name else f"| {name} | {a:.1f} | {b:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--systems", default="kvledger,transformers")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        spec = SIZES[args.size]
        model = build_tiny_llava(os.path.join(d, "llava"), **spec)
        side = spec.get("image_size", 42)
        images = Images((side + 20, side + 8))  # resized and cropped by the processor, as a client's would be
        res: dict = {"size": args.size, "torch_threads": torch.get_num_threads()}
        systems = args.systems.split(",")
        if "kvledger" in systems:
            res["kvledger"] = run_kvledger(model, images, args.repeats, os.path.join(d, "server.log"))
        if "transformers" in systems:
            res["transformers"] = run_transformers(model, images, args.repeats)
    print(json.dumps(res, indent=1))
    if "kvledger" in res and "transformers" in res:
        print(table(res))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
