"""Progress of a prefill run: a bar with tokens/s and ETA on a terminal, log lines otherwise."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

log = logging.getLogger("prefill.progress")


class Progress:
    """Counts computed tokens against a total and reports rate and ETA.

    On a terminal the line is redrawn in place (at most 10 times a second); elsewhere
    (CI, Prefect logs, files) one log line is written every ``log_every_s`` seconds.
    """

    def __init__(self, stream: TextIO | None = None, *, log_every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = log_every_s
        self.clock = clock
        self.total = 0
        self.done = 0
        self._t0 = 0.0
        self._last = 0.0

    def start(self, total_tokens: int) -> None:
        self.total, self.done = total_tokens, 0
        self._t0 = self._last = self.clock()
        if not self.tty:
            log.info("prefill: %d token(s) to compute", total_tokens)

    def advance(self, tokens: int) -> None:
        self.done += tokens
        now = self.clock()
        if self.tty and now - self._last >= 0.1:
            self._last = now
            self.stream.write("\r" + self.line() + " " * 4)
            self.stream.flush()
        elif not self.tty and now - self._last >= self.log_every_s:
            self._last = now
            log.info("prefill: %s", self.line())

    def rate(self) -> float:
        dt = self.clock() - self._t0
        return self.done / dt if dt > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        frac = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        bar = "#" * int(frac * 30)
        eta_s = "?" if eta != eta else f"{eta:,.0f}s"
        return f"[{bar:<30}] {frac:6.1%} {self.done:,}/{self.total:,} tokens  {rate:,.0f} tok/s  ETA {eta_s}"

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
        else:
            log.info("prefill: done, %s", self.line())
