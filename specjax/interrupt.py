"""Ctrl-C on the command line: one line on stderr and exit 130 (128 + SIGINT) within a moment,
whatever the process is doing, never a traceback, a hang or a crash.

``install()`` (the ``specjax`` command calls it before anything heavy loads) sets a SIGINT
handler that leaves at once when the main thread runs Python. While the main thread sits in
C++ for seconds (an XLA compile) no Python handler can run, and a normal exit would wait for
the compiler's threads; so the signal's wakeup byte also wakes a watcher thread, which leaves
for it after ``GRACE`` seconds. Leaving is ``os._exit``: nothing half-built is torn down.

A job that stops gracefully on SIGINT (``specjax batch``: the next round, then a summary)
installs its own handler and names its line with ``saying``; the watcher still leaves after
``GRACE`` with that same line if the job has not, and ``say_once`` keeps the line single.
Imports nothing of specjax.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = ["GRACE", "install", "name", "say_once", "saying"]

GRACE = 0.5  # seconds the main thread gets to leave on its own before the watcher leaves for it
_WHO = ["specjax"]  # who says "interrupted": the command once parsed
_SAY: list[Callable[[], str] | None] = [None]  # a running job's own line
_SAID = threading.Lock()  # taken by whoever writes the one line


def name(who: str) -> None:
    """The line reads ``<who>: interrupted``."""
    _WHO[0] = who


def _line() -> str:
    try:
        return _SAY[0]() if _SAY[0] is not None else f"{_WHO[0]}: interrupted"
    except Exception:  # noqa: BLE001  a broken message never blocks the exit
        return f"{_WHO[0]}: interrupted"


@contextlib.contextmanager
def saying(line: Callable[[], str]) -> Iterator[None]:
    """While a job runs, an interrupt's line is ``line()`` (read when it is written)."""
    _SAY[0] = line
    try:
        yield
    finally:
        _SAY[0] = None


def say_once(text: str) -> bool:
    """Write ``text`` to stderr unless the interrupt's line was already written (by the
    watcher, or by an earlier call); True if written."""
    if not _SAID.acquire(blocking=False):
        return False
    print(text, file=sys.stderr, flush=True)
    return True


def _leave(*_: object) -> None:
    """Write the line (once) and exit 130 now."""
    try:
        if _SAID.acquire(blocking=False):
            if threading.current_thread() is threading.main_thread():
                sys.stdout.flush()  # another thread could hold stdout's lock: the main thread only
            os.write(2, f"\n{_line()}\n".encode())
    finally:
        os._exit(130)


def install() -> None:
    """The handler and its watcher (from the main thread)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGINT, _leave)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            if signal.SIGINT in os.read(read, 16):
                threading.Event().wait(GRACE)  # the main thread first, if it is running Python
                if _SAID.locked():  # the job wrote its line and is leaving: give it one more grace
                    threading.Event().wait(GRACE)
                    os._exit(130)
                _leave()

    threading.Thread(target=watch, daemon=True, name="specjax-interrupt").start()
