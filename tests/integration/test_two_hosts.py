"""Two machines for real: two Linux network namespaces with their own addresses on a veth link
(tests/netns.py), so that binding, advertised addresses and bootstrap hosts are exercised as across
machines, not through 127.0.0.1. PD with the prefill server on host A and the decode server on host
B behind SGLang's router; tensor parallel with node 0 on A and node 1 on B. Kill -9 of either PD side
while a transfer is in flight: the survivor's books are clean within its timeout and it keeps
serving. Greedy fp32 output equals the one plain server's."""

from __future__ import annotations

import concurrent.futures as cf
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import ENGINE_ARGS
from tests.netns import TwoHosts, why_unavailable
from tests.server_harness import books_balance, wait_idle

pytestmark = pytest.mark.skipif(bool(why_unavailable()), reason=str(why_unavailable()))

TIMEOUT_S = "3"  # both sides' transfer timeouts: the kill tests wait them out
BODY = {"text": "Two machines share one conversation", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
SERVE = [sys.executable, "-m", "kvledger", "serve"]


@pytest.fixture
def hosts():
    h = TwoHosts()
    yield h
    h.close()


class Remote:
    """A server started inside a namespace, reached from a client thread in the same namespace."""

    def __init__(self, hosts: TwoHosts, host, port: int, args: list[str], log_path: str):
        self.host, self.url, self.log_path = host, f"http://{host.addr}:{port}", log_path
        self.proc = hosts.start(host, [*SERVE, "--host", host.addr, "--port", str(port), *args], log_path)

    def logs(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.logs()[-3000:]}")
            try:
                if self.host.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url} not healthy:\n{self.logs()[-3000:]}")

    def info(self) -> dict:
        return self.host.get(self.url + "/get_server_info").json()

    def wait_idle_clean(self, timeout: float = 15) -> dict:
        info, idle = self.host.call(wait_idle, self.url, timeout)
        assert idle and books_balance(info) and info["memory"]["leak_check"]["ok"], info["memory"]
        return info

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def pd_key(tmp_path) -> str:
    """The PD nodes' shared key, in a file both hosts read (a bootstrap port off loopback needs one)."""
    path = tmp_path / "pd.key"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return str(path)


def start_prefill(hosts: TwoHosts, chat_model: str, tmp_path, port: int) -> Remote:
    """The prefill server on host A; its bootstrap port is ``port + 1``, on A's address."""
    args = ["--model", chat_model, *ENGINE_ARGS, "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(port + 1), "--disaggregation-bootstrap-timeout", TIMEOUT_S,
            "--disaggregation-bind-host", hosts.a.addr, "--disaggregation-auth-key-file", pd_key(tmp_path)]  # fmt: skip
    return Remote(hosts, hosts.a, port, args, str(tmp_path / f"prefill{port}.log"))


def start_decode(hosts: TwoHosts, chat_model: str, tmp_path, port: int, bport: int) -> Remote:
    """The decode server on host B (pages of 4: the transfer is token-granular), fetching KV from the
    prefill server's bootstrap port ``bport`` on A."""
    args = ["--model", chat_model, *ENGINE_ARGS, "--page-size", "4", "--disaggregation-mode", "decode",
            "--disaggregation-waiting-timeout", TIMEOUT_S, "--disaggregation-prefill-peers", f"{hosts.a.addr}:{bport}",
            "--disaggregation-auth-key-file", pd_key(tmp_path)]  # fmt: skip
    return Remote(hosts, hosts.b, port, args, str(tmp_path / f"decode{port}.log"))


def start_router(hosts: TwoHosts, pre: Remote, dec: Remote, bport: int, tmp_path) -> str:
    """SGLang's router on host A's loopback, its prefill worker on A's address, its decode on B's."""
    port = 31900
    hosts.start(hosts.a, [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                          str(port), "--pd-disaggregation", "--prefill", pre.url, str(bport), "--decode", dec.url,
                          "--policy", "round_robin", "--worker-startup-check-interval", "1",
                          "--health-check-interval-secs", "1", "--prometheus-port", "31901"],
                str(tmp_path / "router.log"))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if hosts.a.get(url + "/health", timeout=1).status_code == 200:
                return url
        except Exception:
            pass
        assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-3000:]
        time.sleep(0.3)


# ~770 tokens of the tiny model: a prefill of many chunks, so a kill lands while KV is in flight.
LONG = {"text": "Across the link. " * 45, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def background(fn) -> cf.Future:
    return cf.ThreadPoolExecutor(max_workers=1).submit(fn)


def decode_half(hosts: TwoHosts, dec: Remote, bport: int, room: int, body: dict) -> cf.Future:
    """The decode half of a request, as the router sends it, left running; returns once decode holds
    pages waiting for its KV (its claim is on the way to prefill on host A)."""
    rdv = {"bootstrap_host": hosts.a.addr, "bootstrap_port": bport, "bootstrap_room": room}
    d = background(lambda: hosts.b.post(dec.url + "/generate", json={**body, **rdv}, timeout=60))
    deadline = time.monotonic() + 30
    while dec.info()["memory"]["kv_private"] == 0:
        assert not d.done(), d.result().text
        assert time.monotonic() < deadline, "decode never admitted the request"
        time.sleep(0.02)
    return d


def prefill_half(hosts: TwoHosts, pre: Remote, bport: int, room: int, body: dict) -> httpx.Response:
    rdv = {"bootstrap_host": hosts.a.addr, "bootstrap_port": bport, "bootstrap_room": room}
    return hosts.a.post(pre.url + "/generate", json={**body, **rdv}, timeout=60)


def reference(server, body: dict) -> list[int]:
    """The plain server's greedy output (it runs in the box's own namespace)."""
    return httpx.post(server.url + "/generate", json=body, timeout=60).json()["output_ids"]


def test_pd_across_two_hosts(hosts, chat_model, server, tmp_path):
    """Through the router across the link: one server's output. Then kill -9 of decode, holding a
    session's KV, while a transfer is in flight (prefill frees within its timeout and serves on), a new decode server, and
    kill -9 of prefill while a transfer is in flight (decode frees within its timeout, serves on)."""
    pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")
    bport = 31001
    pre, dec = start_prefill(hosts, chat_model, tmp_path, 31000), start_decode(hosts, chat_model, tmp_path, 31002, bport)
    pre.wait_healthy()
    dec.wait_healthy()
    # The bootstrap port listens on host A's address, not loopback: decode on B reaches it there.
    assert pre.info()["disaggregation"]["bootstrap"] == f"{hosts.a.addr}:{bport}", pre.info()["disaggregation"]
    assert pre.info()["disaggregation"]["authenticated"] and dec.info()["disaggregation"]["authenticated"]
    router = start_router(hosts, pre, dec, bport, tmp_path)
    for text in ["Two machines share one conversation", "A longer prompt that crosses pages " * 4]:
        body = {**BODY, "text": text}
        via = hosts.a.post(router + "/generate", json=body)
        assert via.status_code == 200, via.text
        assert via.json()["output_ids"] == reference(server, body)
    assert dec.info()["disaggregation"]["transfers_ok"] == 2
    pre.wait_idle_clean()
    dec.wait_idle_clean()

    # Decode holds a session's KV (a turn through the router; the session opened on decode).
    sid = hosts.b.post(dec.url + "/open_session", json={}).json()
    turn = hosts.a.post(router + "/generate", json={**BODY, "session_params": {"id": sid}})
    assert turn.status_code == 200 and turn.json()["output_ids"] == reference(server, BODY), turn.text
    assert dec.info()["memory"]["kv_session"] > 0
    # Kill -9 of decode (holding that session) after its claim: prefill computes the KV for a peer
    # that is gone, holds it unacknowledged, and frees it within its bootstrap timeout.
    decode_half(hosts, dec, bport, 77, LONG)
    dec.kill9()
    prefill_half(hosts, pre, bport, 77, LONG)  # whatever it answers: its half ran
    pre.wait_idle_clean(timeout=15)
    ok = hosts.a.post(pre.url + "/generate", json=BODY)  # no room: served whole, as a plain server
    assert ok.status_code == 200 and ok.json()["output_ids"] == reference(server, BODY)
    pre.wait_idle_clean()

    # A new decode server; kill -9 of prefill while decode waits for the KV it claimed: decode gives
    # up within its timeout, frees, and serves on.
    dec = start_decode(hosts, chat_model, tmp_path, 31003, bport)
    dec.wait_healthy()
    d = decode_half(hosts, dec, bport, 78, LONG)
    pre.kill9()
    r = d.result(timeout=60)
    assert r.status_code >= 500 and "prefill" in r.text.lower(), r.text  # a 5xx naming it, not a hang
    dec.wait_idle_clean(timeout=15)
    ok = hosts.b.post(dec.url + "/generate", json=BODY)
    assert ok.status_code == 200 and ok.json()["output_ids"] == reference(server, BODY)
    dec.wait_idle_clean()


def listening(host) -> list[str]:
    """The local address:port of every TCP socket listening in ``host``'s namespace."""
    out = subprocess.run(["ip", "netns", "exec", host.name, "ss", "-ltnH"], check=True, capture_output=True, text=True)
    return [line.split()[3] for line in out.stdout.splitlines()]


def test_tensor_parallel_across_two_hosts(hosts, chat_model, server, tmp_path):
    """Node 0 (rank 0, HTTP) on A, node 1 (rank 1) on B; the rendezvous on A's address, the nodes
    sharing a key file. Once the group serves, nothing on A listens on every interface and the
    rendezvous port is closed (issue 50 item 8: before, torch's store listened on *:34001 for good)."""
    key = tmp_path / "tp.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    multi = ["--model", chat_model, *ENGINE_ARGS, "--tp-size", "2", "--nnodes", "2",
             "--dist-init-addr", f"{hosts.a.addr}:34001", "--dist-auth-key-file", str(key)]  # fmt: skip
    node1 = hosts.start(hosts.b, [*SERVE, "--host", hosts.b.addr, *multi, "--node-rank", "1"], str(tmp_path / "n1.log"))
    node0 = Remote(hosts, hosts.a, 34000, [*multi, "--node-rank", "0"], str(tmp_path / "n0.log"))
    node0.wait_healthy()
    assert node0.info()["engine"]["tp_size"] == 2
    for text in ["Two machines share one conversation", "A longer prompt that crosses pages " * 4]:
        body = {**BODY, "text": text}
        whole = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        got = hosts.a.post(node0.url + "/generate", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == whole["output_ids"]
    node0.wait_idle_clean()
    assert node1.poll() is None, (tmp_path / "n1.log").read_text()[-2000:]
    on_a = listening(hosts.a)
    assert f"{hosts.a.addr}:34000" in on_a and not any(a.endswith(":34001") for a in on_a), on_a
    assert all(a.startswith((f"{hosts.a.addr}:", "127.0.0.1:")) for a in on_a), on_a


def doc_recipe(name: str) -> list[list[str]]:
    """The commands of docs/deployment.md's ``<!-- recipe:NAME -->`` block (moved from the README, issue
    53), continuation lines joined."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    block = text.split(f"<!-- recipe:{name} -->", 1)[1].split("<!-- /recipe -->", 1)[0]
    body = block.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line) for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_readmes_pd_tp_hicache_recipe_across_two_hosts(hosts, chat_model, server, tmp_path):
    """docs/deployment.md's two-machine recipe, as written: prefill (TP 2, tiers) on A, decode (TP 2, tiers)
    on B, the router on A. Only the model, the engine's test settings and the addresses change."""
    pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")
    cmds = doc_recipe("pd-tp-hicache")
    assert cmds[0][:2] == ["openssl", "rand"] and cmds[0][-1] == "pd.key", cmds[0]  # the shared key, made here
    cmds = cmds[1:]
    assert [c[:2] for c in cmds] == [["kvledger", "serve"]] * 2 + [["python", "-m"]], cmds
    swap = {"10.0.0.1": hosts.a.addr, "10.0.0.2": hosts.b.addr, "pd.key": pd_key(tmp_path)}

    def addrs(tokens: list[str]) -> list[str]:
        out = []
        for t in tokens:
            for old, new in swap.items():
                t = t.replace(old, new)
            out.append(t)
        return out

    servers = []
    for k, cmd in enumerate(cmds[:2]):
        args = addrs(cmd[2:])
        host = hosts.a if args[args.index("--host") + 1] == hosts.a.addr else hosts.b
        port = int(args[args.index("--port") + 1])
        rest = [a for i, a in enumerate(args) if a not in ("--host", "--port") and args[i - 1] not in ("--host", "--port")]
        servers.append(Remote(hosts, host, port, [*rest, "--model", chat_model, *ENGINE_ARGS], str(tmp_path / f"s{k}.log")))
    for s in servers:
        s.wait_healthy()
    assert [s.host for s in servers] == [hosts.a, hosts.b]
    router_args = addrs(cmds[2][1:])
    hosts.start(hosts.a, [sys.executable, *router_args, "--worker-startup-check-interval", "1",
                          "--health-check-interval-secs", "1"], str(tmp_path / "router.log"))  # fmt: skip
    router = f"http://127.0.0.1:{router_args[router_args.index('--port') + 1]}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if hosts.a.get(router + "/health", timeout=1).status_code == 200:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-3000:]
        time.sleep(0.3)
    for s in servers:
        info = s.info()
        assert info["engine"]["tp_size"] == 2 and info["memory"]["hicache"] is not None, info["engine"]
    for text in ["Two machines share one conversation", "A longer prompt that crosses pages " * 4]:
        body = {**BODY, "text": text}
        via = hosts.a.post(router + "/generate", json=body)
        assert via.status_code == 200, via.text
        assert via.json()["output_ids"] == reference(server, body)
    for s in servers:
        s.wait_idle_clean()
