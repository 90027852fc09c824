"""The hierarchical cache through the real server: a restart on the same storage dir starts warm
(cached_tokens > 0 for a long prompt served before it, same output), the tiers in /get_server_info
and /metrics, and bad flags refused before anything starts."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys

import httpx
import openai
import pytest

from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Server

HIER = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]


def _start(model: str, tmp_path, d: str, name: str) -> Server:
    # A small L1 (512 tokens): the second workload below pushes the first prompt out of it.
    args = [a for a in ENGINE_ARGS]
    args[args.index("--max-total-tokens") + 1] = "512"
    s = Server(model, *args, *HIER, "--hicache-storage-dir", d, log_path=str(tmp_path / f"{name}.log"))
    s.wait_healthy()
    return s


def _chat(srv: Server, text: str):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    return c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0
    )


def test_restart_on_the_same_storage_dir_starts_warm(chat_model, tmp_path):
    rng = random.Random(0)
    long_prompt = " ".join(f"w{rng.randrange(1000)}" for _ in range(80))  # ~400 tokens (byte-level)
    d = str(tmp_path / "l3")
    srv = _start(chat_model, tmp_path, d, "first")
    try:
        first = _chat(srv, long_prompt)
        for i in range(3):  # other long prompts: the first one leaves L1
            _chat(srv, " ".join(f"x{i}{rng.randrange(1000)}" for _ in range(80)))
        again = _chat(srv, long_prompt)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 300, again.usage
        info = srv.wait_idle_clean()
        h = info["memory"]["hicache"]
        assert h["l2_hit_tokens"] > 300 and h["l3_files"] > 0 and h["l2_storing"] == 0, h
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'kvledger_hicache_tokens{state="cached"}' in metrics
        assert 'kvledger_hicache_l3{what="l3_files"}' in metrics
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]
    srv = _start(chat_model, tmp_path, d, "second")
    try:
        warm = _chat(srv, long_prompt)
        assert warm.choices[0].message.content == first.choices[0].message.content
        assert warm.usage.prompt_tokens_details.cached_tokens > 300, warm.usage
        info = srv.wait_idle_clean()
        assert info["memory"]["hicache"]["l3_hit_tokens"] > 300, info["memory"]["hicache"]
    finally:
        assert srv.stop() == 0, srv.logs()[-3000:]


def _refused(*flags: str, timeout: float = 120) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", *flags], capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    return r.stderr


def test_bad_hierarchical_cache_flags_are_one_line_of_error():
    assert "hicache-storage-dir" in _refused(*HIER)
    assert "enable-hierarchical-cache" in _refused(
        "--hicache-storage-backend", "file", "--hicache-storage-dir", "/tmp/x"
    )
    assert "hicache_ratio" in _refused("--enable-hierarchical-cache", "--hicache-ratio", "-1")
    assert "invalid choice" in _refused("--enable-hierarchical-cache", "--hicache-write-policy", "later")


@contextlib.contextmanager
def _read_only_mount(path: str, mode: str):
    """An empty tmpfs mounted read-only at ``path``: what a read-only volume is. Needs root (CI and
    the dev machines run as root, which a chmod alone would not stop from writing)."""
    os.makedirs(path)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"ro,size=1m,mode={mode}", "tmpfs", path], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=True)


@pytest.mark.parametrize(
    "how, why",
    [
        ("read-only mount, 0500", "cannot be made private (0700) (Read-only file system)"),
        ("read-only mount, 0700, no salt", "does not take a new file (Read-only file system)"),
        ("under a read-only mount", "cannot be created (Read-only file system)"),
        ("a file in its place", "cannot be created"),
        ("its salt unreadable", "salt file cannot be read or created"),
    ],
)
def test_an_unusable_storage_dir_is_one_line_of_error_before_anything_starts(tmp_path, how, why):
    """Refused (exit 2), not served without the file tier: a deployment that asked for persistence
    would lose it silently. Before the fix the engine died on it and the front restarted it forever."""
    with contextlib.ExitStack() as stack:
        if how.startswith("read-only mount"):
            mode = "0500" if "0500" in how else "0700"
            d = stack.enter_context(_read_only_mount(str(tmp_path / "ro"), mode))
        elif how == "under a read-only mount":
            d = os.path.join(stack.enter_context(_read_only_mount(str(tmp_path / "ro"), "0700")), "l3")
        elif how == "a file in its place":
            d = str(tmp_path / "l3")
            open(d, "w").close()
        else:
            d = str(tmp_path / "l3")
            os.makedirs(d, mode=0o700)
            os.mkdir(os.path.join(d, "salt"))  # a directory where the salt file goes
        err = _refused(*HIER, "--hicache-storage-dir", d, timeout=60)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvledger: error: --hicache-storage-dir {d} cannot be used: "), err
    assert why in lines[0], err
