"""Leave a finished process without the interpreter's teardown.

A process that imported torch and transformers spends 0.5 s (an idle 2-core box) to several seconds
(a loaded one) after its last line in ``Py_FinalizeEx``, tearing those modules down one object at a
time; nothing it frees there outlives the process anyway. ``kvledger serve``'s front and its engine
process both paid it on every stop (the integration suite stops ~65 servers). ``exit_now`` does what
the normal exit does that matters (joins the threads the interpreter would wait for, runs the
``atexit`` handlers: logging's flush, multiprocessing's reaping of children, the libraries' own,
flushes the standard streams) and then ``os._exit``s, skipping only the teardown.

Only for the ends of processes kvledger owns (``python -m kvledger``, the spawned engine): never from
code a caller may run in its own process (``cli.main`` is called in-process by the tests)."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """Exit with ``code`` (``None`` is 0, as ``sys.exit``) once non-daemon threads end, the atexit
    handlers ran and the standard streams are flushed; the interpreter's teardown is skipped."""
    main = threading.main_thread()
    for t in threading.enumerate():  # what the interpreter's own exit waits for first
        if t is not main and not t.daemon and t.is_alive():
            t.join()
    atexit._run_exitfuncs()  # the handlers, in the order the interpreter would run them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or replaced: nothing to write
            stream.flush()
    os._exit(code or 0)
