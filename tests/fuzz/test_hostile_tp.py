"""Hostile peers at a tensor-parallel server's ports (issue 50 item 8; the hostile-client fuzz's TP part).

``kvledger serve --tp-size 2`` with its rendezvous on a known port. While the group forms, an attacker
who reaches that port sends garbage on raw connections, lists and reads the store's keys, and replays
rank 0's address as rank 1's before rank 1 writes it: the group forms anyway, with the real rank 1
(the replayed value carries no valid HMAC and is never used). While the engine serves, the rendezvous
port is closed, and every port the engine and its worker listen on (gloo's) gets garbage, a replayed
step frame and a pickle: a bystander request running meanwhile completes with the same tokens as
before, the engine never restarts, and the books are clean at the end.

The helpers (``garbage_to``, ``replay_into_rendezvous``, ``listening_ports``) are the fuzz's to reuse.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime
import pickle
import random
import socket
import struct
import threading
import time

import httpx
import psutil

from kvledger.parallel import frames, rendezvous
from kvledger.scheduler.output import ScheduledReq, SchedulerOutput
from tests.server_harness import Server, free_port

ENGINE_ARGS = ["--dtype", "float32", "--strict-memory", "--page-size", "16", "--max-total-tokens", "2048",
               "--chunked-prefill-size", "64", "--context-length", "512", "--log-level", "warning"]  # fmt: skip
BODY = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


class Plant:
    def __reduce__(self):
        return (print, ("a pickle ran on a rank",))


def hostile_payloads(rng: random.Random) -> list[bytes]:
    """Garbage of several sizes, a step frame as rank 0 would send it (length-prefixed, replayed), a
    pickle, a length prefix far past any frame, and a TCPStore-looking header."""
    step = bytes(frames.encode(frames.Step.of(SchedulerOutput([ScheduledReq("x", 0, 0, [1, 2, 3])]))))
    evil = pickle.dumps(Plant())
    return [
        *(rng.randbytes(n) for n in (1, 7, 64, 4096)),
        struct.pack("<q", len(step)) + step,
        struct.pack("<q", len(evil)) + evil,
        struct.pack("<q", 1 << 62) + b"\0" * 32,
        b"\x00" * 8 + struct.pack("<I", 0xFFFFFFFF) + rng.randbytes(16),
    ]


def garbage_to(host: str, port: int, rng: random.Random) -> int:
    """Send every hostile payload to ``host:port``, one connection each; returns how many connected."""
    sent = 0
    for payload in hostile_payloads(rng):
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(payload)
                s.settimeout(0.2)
                with contextlib.suppress(OSError):
                    s.recv(64)  # whatever it answers (or closes with)
                sent += 1
        except OSError:
            pass
    return sent


def replay_into_rendezvous(host: str, port: int, deadline: float) -> dict:
    """While a group forms at ``host:port``: list and read every key, then write rank 0's address
    (gloo's key ``.../0``) as rank 1's where rank 1 has not written yet. What the attacker saw."""
    import torch.distributed as dist

    seen: dict = {"keys": [], "replayed": False}
    spy = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
    while time.monotonic() < deadline:
        keys = spy.list_keys()
        mine = [k for k in keys if k.endswith("/0") and k != rendezvous.HELLO]
        if mine:
            seen["keys"] = keys
            value = spy.get(mine[0])
            seen["replayed"] = spy.compare_set(mine[0][:-1] + "1", b"", value) == value
            return seen
        time.sleep(0.01)
    return seen


def listening_ports(pids: list[int]) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for pid in pids
            for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}  # fmt: skip


def attack_while_forming(port: int, rng: random.Random, out: dict) -> None:
    """Wait for the rendezvous port to open, then garbage and the replay."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.005)
    try:
        out["spy"] = replay_into_rendezvous("127.0.0.1", port, time.monotonic() + 30)
        out["garbage"] = garbage_to("127.0.0.1", port, rng)
    except Exception as e:  # the store closed under us: reported by the test
        out["error"] = repr(e)


def test_a_tp_server_survives_hostile_peers_at_its_ports(chat_model, tmp_path):
    rng = random.Random(50)
    port = free_port()
    seen: dict = {}
    attacker = threading.Thread(target=attack_while_forming, args=(port, rng, seen), daemon=True)
    attacker.start()
    s = Server(chat_model, *ENGINE_ARGS, "--tp-size", "2", "--dist-init-addr", f"127.0.0.1:{port}",
               log_path=str(tmp_path / "tp.log"))  # fmt: skip
    try:
        s.wait_healthy()
        attacker.join(timeout=60)
        assert garbage_to("127.0.0.1", port, rng) == 0  # the group formed: the rendezvous port is closed
        assert "error" not in seen and seen["spy"]["replayed"], seen  # the replay landed before rank 1 wrote
        assert "without the group's HMAC" in s.logs()  # ... and was seen and not used
        first = httpx.post(s.url + "/generate", json=BODY, timeout=60).json()["output_ids"]
        info = s.info()
        pids = [info["engine_pid"], *info["engine"]["tp_worker_pids"]]
        ports = {p for _, p in listening_ports(pids)}
        assert ports and port not in ports
        with cf.ThreadPoolExecutor(max_workers=2) as pool:
            bystander = pool.submit(lambda: [httpx.post(s.url + "/generate", json=BODY, timeout=60).json()["output_ids"]
                                             for _ in range(3)])  # fmt: skip
            for p in sorted(ports):
                for _ in range(3):
                    garbage_to("127.0.0.1", p, rng)
            assert bystander.result(timeout=120) == [first] * 3
        assert httpx.post(s.url + "/generate", json=BODY, timeout=60).json()["output_ids"] == first
        info = s.wait_idle_clean()
        assert info["engine_restarts"] == 0 and "a pickle ran" not in s.logs()
    finally:
        assert s.stop() == 0
