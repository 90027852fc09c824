"""A real headless Chromium, driven over the DevTools protocol (CDP), for tests of the dashboard.

Chromium is Debian's ``chromium`` package (.ci/run installs it); ``find_chromium()`` is None where it
is absent and the tests skip with that reason. ``open`` can add headers to every request of the
page (``Network.setExtraHTTPHeaders``); the dashboard test instead logs in through the page's own
form, as an operator does.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import httpx


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page; ``evaluate`` runs JavaScript in it."""

    def __init__(self, binary: str):
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="kvledger-chromium-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # CI runs as root
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "--window-size=1200,900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and pathlib.Path(port_file).read_text().count("\n") >= 1):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(pathlib.Path(port_file).read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(
            connect(pages[0]["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024)
        )
        self._ids = itertools.count(1)

    def send(self, method: str, **params) -> dict:
        i = next(self._ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def open(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.send("Network.enable")
        if headers:
            self.send("Network.setExtraHTTPHeaders", headers=headers)
        self.send("Page.enable")
        self.send("Page.navigate", url=url)

    def evaluate(self, expression: str):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JavaScript failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                value = self.evaluate(expression)
                if value:
                    return value
            time.sleep(0.1)
        raise TimeoutError(f"never true in the page: {expression}")

    def screenshot(self, path: str) -> None:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        if hasattr(self, "_stack"):
            with contextlib.suppress(Exception):
                self._stack.close()
        self.proc.kill()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)
