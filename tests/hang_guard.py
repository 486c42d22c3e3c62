"""A guard against a call that hangs: generous, and never a test of speed.

Tests assert what happened, not how long it took; but a call that must not hang (a
lookup while S3 is down, an S3 call while the server is stopped) is run on a thread, so
that a hang fails the test instead of stalling the suite.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: far beyond any timeout the tests configure (seconds): only a hang gets here
HANG_S = 300.0


def returns(fn: Callable[..., T], *args: Any, within_s: float = HANG_S, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run on a daemon thread: its result, or the exception it raised.

    Fails the test if the call has not returned within ``within_s`` (it is left running).
    """
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller below
            out["error"] = exc

    th = threading.Thread(target=run, name=f"hang-guard-{getattr(fn, '__name__', 'call')}", daemon=True)
    th.start()
    th.join(within_s)
    if th.is_alive():
        raise AssertionError(f"{getattr(fn, '__qualname__', fn)} hung: no return within {within_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]
