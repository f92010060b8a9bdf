"""Time limits on the steps of a benchmark point (a backend's setup: ``setup_timeout_s``), so that one backend that
never finishes its compiles becomes a ``timeout`` row and the point goes on with the next."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional


class StepTimeout(Exception):
    """Raised in the main thread when a step runs past its limit (:func:`time_limit`)."""


@contextlib.contextmanager
def time_limit(seconds: Optional[float], what: str) -> Iterator[None]:
    """Raise :class:`StepTimeout` in the main thread once ``seconds`` have passed (SIGALRM), unless the body is done.
    No limit for None / 0, off the main thread, or where there is no SIGALRM. Python code and waits on pipes or
    subprocesses are interrupted; a rank blocked inside one C call (a collective, a kernel compile in-process)
    sees it only when that call returns."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):
        raise StepTimeout(f"{what} ran past setup_timeout_s={seconds:g} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
