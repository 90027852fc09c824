"""Grammar compiles off the engine's thread: ``CompilePool`` runs them on a few daemon threads,
``GrammarJob`` is one request's compile as the scheduler sees it (``poll`` at its safe points, ``wait``
for the offline API), with its deadline (``--grammar-compile-timeout-s``)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import ServiceUnavailable, ValidationError


class GrammarJob:
    """One request's grammar compiling on the backend's threads (``GrammarBackend.start``)."""

    def __init__(self, kind: str, future: Future, timeout_s: float, wrap: Callable[[object], object]):
        self.kind = kind
        self.future = future
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._wrap = wrap  # the compiled state -> the request's grammar (behind a ReasoningGate or not)

    def poll(self, now: float | None = None) -> object | None:
        """The request's grammar once compiled, None while it compiles; the compile's error
        (a ``KVLedgerError``) if it failed or passed its deadline."""
        if self.future.done():
            return self._result(0.0)
        if (time.monotonic() if now is None else now) >= self.deadline:
            self.cancel()
            raise self._timed_out()
        return None

    def wait(self) -> object:
        """Block until the grammar is compiled (or its deadline): ``poll``'s answer, never None."""
        return self._result(max(0.0, self.deadline - time.monotonic()))

    def _result(self, wait_s: float) -> object:
        try:
            state = self.future.result(timeout=wait_s)
        except FutureTimeout:
            self.cancel()
            raise self._timed_out() from None
        except CancelledError:  # (the backend shut down before it ran)
            raise ServiceUnavailable("the engine is shutting down", code="grammar_cancelled") from None
        return self._wrap(state)

    def cancel(self) -> None:
        """A compile that has not started never will; one that runs cannot be stopped (xgrammar has
        no way to): it ends on its thread, and its result goes to xgrammar's cache."""
        self.future.cancel()

    def _timed_out(self) -> ValidationError:
        return ValidationError(
            f"the {self.kind} took longer than {self.timeout_s:g} s to compile (--grammar-compile-timeout-s); "
            "send a smaller or simpler one",
            param=self.kind,
            code="grammar_compile_timeout",
        )


class CompilePool:
    """Runs compiles on at most ``threads`` daemon threads, started on first use. Daemon threads:
    a process exits without waiting for a compile that cannot be interrupted, which the threads of
    ``concurrent.futures`` would make it do."""

    def __init__(self, threads: int):
        self.threads = threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._work, name="kvledger-grammar", daemon=True).start()
        self._queue.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while it waited: its request has ended
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # the future carries it to the engine's thread
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Queued compiles are dropped (their futures cancelled); idle threads end."""
        with self._lock:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
            for _ in range(self._started):
                self._queue.put(None)
            self._started = 0
