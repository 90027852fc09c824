"""The tensor-parallel rendezvous (parallel/rendezvous.py, issue 50 item 8), without a model: rank 0
listens on the configured address only and closes the port once the group formed; a rank without the
group's key is refused before the group forms; a value in the store without the group's HMAC (here
rank 0's own address replayed as rank 1's) is never used; the real group still forms."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvledger.config import DIST_AUTH_KEY_ENV, EngineConfig
from kvledger.errors import ValidationError
from kvledger.launch.validate import check_settings
from kvledger.parallel import rendezvous

RANK1 = """
import torch, torch.distributed as dist
from kvledger.config import EngineConfig
from kvledger.parallel.executor import join_group
from kvledger.parallel.rendezvous import key_from_launcher
import sys
join_group(EngineConfig.from_flat(tp_size=2, dist_timeout_s=60), 1, sys.argv[1], key_from_launcher())
t = torch.full((3,), 2.0)
dist.all_reduce(t)
print("sum", t.tolist(), flush=True)
dist.destroy_process_group()
"""


def connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def rank1(addr: str, key: bytes) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **rendezvous.handoff_env(key)}
    return subprocess.run([sys.executable, "-c", RANK1, addr], env=env, capture_output=True, text=True, timeout=120)


def replay_rank0_address_as_rank1(port: int) -> bool:
    """What anyone who reaches the port can do: list the keys, read rank 0's address (gloo's key
    ``.../0``) and write it as rank 1's before rank 1 does. True if the write landed."""
    import datetime

    import torch.distributed as dist

    spy = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
    deadline = time.monotonic() + 30
    while not (mine := [k for k in spy.list_keys() if k.endswith("/0") and k != rendezvous.HELLO]):
        assert time.monotonic() < deadline, spy.list_keys()
        time.sleep(0.05)
    value = spy.get(mine[0])
    target = mine[0][:-1] + "1"
    landed = spy.compare_set(target, b"", value) == value  # only where rank 1 has not written
    del spy
    return landed


def test_the_group_forms_only_with_the_key_on_the_configured_address(caplog):
    import torch
    import torch.distributed as dist

    from kvledger.parallel.executor import join_group

    caplog.set_level(logging.WARNING, logger="kvledger.parallel")
    key = os.urandom(32)
    listener = rendezvous.listen(None)
    host, port = listener.getsockname()[:2]
    addr = f"127.0.0.1:{port}"
    assert host == "127.0.0.1"
    got: dict = {}

    def rank0() -> None:
        try:
            join_group(EngineConfig.from_flat(tp_size=2, dist_timeout_s=60), 0, addr, key, listener)
            t = torch.full((3,), 1.0)
            dist.all_reduce(t)
            got["sum"] = t.tolist()
        except BaseException as e:  # reported by the test below
            got["error"] = e
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    t0 = threading.Thread(target=rank0, daemon=True)
    t0.start()
    deadline = time.monotonic() + 30
    while not connects("127.0.0.1", port):
        assert time.monotonic() < deadline and "error" not in got, got
        time.sleep(0.05)
    # Loopback is all of 127/8: a socket on every interface would answer at 127.0.0.2 too.
    assert not connects("127.0.0.2", port)

    assert replay_rank0_address_as_rank1(port)
    refused = rank1(addr, os.urandom(32))  # a rank that does not hold the key
    assert refused.returncode != 0 and "does not hold this rank's key" in refused.stderr, refused.stderr[-2000:]
    joined = rank1(addr, key)
    assert joined.returncode == 0 and "sum [3.0, 3.0, 3.0]" in joined.stdout, joined.stderr[-2000:]
    t0.join(timeout=60)
    assert got.get("sum") == [3.0, 3.0, 3.0], got
    assert "without the group's HMAC" in caplog.text  # the replayed address was seen and not used
    assert not connects("127.0.0.1", port)  # the group formed: the rendezvous port is closed


def test_the_key_comes_from_the_file_the_environment_or_is_made_per_launch(tmp_path, monkeypatch):
    monkeypatch.delenv(DIST_AUTH_KEY_ENV, raising=False)
    one = EngineConfig.from_flat(tp_size=2)
    assert len(rendezvous.auth_key(one)) == 32 and rendezvous.auth_key(one) != rendezvous.auth_key(one)
    with pytest.raises(ValidationError, match="dist-auth-key-file") as e:
        check_settings(EngineConfig.from_flat(tp_size=2, nnodes=2, dist_init_addr="10.0.0.1:5000"))
    assert e.value.param == "dist_auth_key_file"
    path = tmp_path / "key"
    path.write_text("  a-shared-secret-of-enough-bytes\n")
    path.chmod(0o600)
    two = EngineConfig.from_flat(tp_size=2, nnodes=2, dist_init_addr="10.0.0.1:5000", dist_auth_key_file=str(path))
    assert rendezvous.auth_key(two) == b"a-shared-secret-of-enough-bytes"
    path.write_text("short")
    with pytest.raises(ValidationError, match="at least 16"):
        rendezvous.auth_key(two)
    with pytest.raises(ValidationError, match="No such file"):
        rendezvous.auth_key(EngineConfig.from_flat(tp_size=2, dist_auth_key_file=str(tmp_path / "none")))
    monkeypatch.setenv(DIST_AUTH_KEY_ENV, "from-the-environment-0123")
    env = EngineConfig.from_flat(tp_size=2, nnodes=2, dist_init_addr="10.0.0.1:5000")
    check_settings(env)
    assert rendezvous.auth_key(env) == b"from-the-environment-0123"
    # A launcher hands the key to its ranks in their environment; a rank takes it out of its own.
    monkeypatch.setitem(os.environ, rendezvous.KEY_HANDOFF_ENV, rendezvous.handoff_env(b"k" * 20)[rendezvous.KEY_HANDOFF_ENV])
    assert rendezvous.key_from_launcher() == b"k" * 20 and rendezvous.KEY_HANDOFF_ENV not in os.environ


def test_a_configured_address_that_is_not_this_machines_is_refused():
    with pytest.raises(ValidationError, match="must be an address of node 0") as e:
        rendezvous.listen("192.0.2.1:29999")  # TEST-NET-1: never a local address
    assert e.value.param == "dist_init_addr"


def test_the_shared_memory_file_is_this_users_alone(tmp_path):
    """One machine's ranks exchange hidden states through a file in /dev/shm: created 0600 (before:
    0644, every local user could read every request's activations), and never through an existing
    file or a link planted at its name."""
    from kvledger.comm import ShmComm

    path = tmp_path / "shm"
    ShmComm(0, 2, str(path), 64, create=True)
    assert (path.stat().st_mode & 0o777) == 0o600
    planted = tmp_path / "planted"
    planted.write_bytes(b"keep")
    (tmp_path / "link").symlink_to(planted)
    with pytest.raises(FileExistsError):
        ShmComm(0, 2, str(tmp_path / "link"), 64, create=True)
    assert planted.read_bytes() == b"keep"
