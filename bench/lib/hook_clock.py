"""Seconds spent in a set of timed functions, in all and per name (bench/lib/timed_connector.py).

Pure: no vLLM here, so that it is tested in the project's venv.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any


class HookClock:
    """Seconds spent in the connector's hooks: in all, and per hook (calls, seconds, the longest call).

    A hook that calls another (``request_finished_all_groups`` calls ``request_finished``) is
    counted once, as the outer call.
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.calls = 0
        self.by_hook: dict[str, list[float]] = {}  # name -> [calls, seconds, longest call's seconds]
        self._depth = threading.local()

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a hook of the connector) timed under ``name``."""
        depth = self._depth

        @functools.wraps(fn)
        def hook(*args: Any, **kwargs: Any) -> Any:
            level = getattr(depth, "n", 0)
            if level:
                return fn(*args, **kwargs)
            depth.n = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                depth.n = 0
                self.total_s += dt
                self.calls += 1
                entry = self.by_hook.setdefault(name, [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += dt
                entry[2] = max(entry[2], dt)

        return hook

    def reset_peaks(self) -> None:
        """Forget the longest calls so far (a measurement window starts)."""
        for entry in self.by_hook.values():
            entry[2] = 0.0

    def snapshot(self) -> dict[str, Any]:
        """The totals so far: ``total_s``, ``calls`` and ``by_hook`` (name -> calls, seconds, ``max_s``:
        the longest call since the start or :meth:`reset_peaks`)."""
        return {"total_s": self.total_s, "calls": self.calls,
                "by_hook": {k: {"calls": int(c), "seconds": s, "max_s": m}
                            for k, (c, s, m) in sorted(self.by_hook.items())}}
