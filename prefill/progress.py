"""Progress of a prefill run: a tqdm bar (tokens/s, ETA) on a terminal, plain log lines otherwise."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

log = logging.getLogger("prefill.progress")


class Progress:
    """Counts computed tokens against a total and reports rate and ETA.

    On a terminal, a tqdm bar on ``stream``; elsewhere (CI, Prefect logs, files) one log
    line every ``log_every_s`` seconds of ``clock``, so a log is not flooded with
    carriage returns.
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
        self._bar: tqdm | None = None

    def start(self, total_tokens: int) -> None:
        """Begin counting towards ``total_tokens``."""
        self.total, self.done = total_tokens, 0
        self._t0 = self._last = self.clock()
        if self.tty:
            self._bar = tqdm(total=total_tokens, desc="prefill", unit="tok", unit_scale=True, file=self.stream,
                             dynamic_ncols=True)
        else:
            log.info("prefill: %d token(s) to compute", total_tokens)

    def advance(self, tokens: int) -> None:
        """``tokens`` more were computed."""
        self.done += tokens
        if self._bar is not None:
            self._bar.update(tokens)
            return
        now = self.clock()
        if now - self._last >= self.log_every_s:
            self._last = now
            log.info("prefill: %s", self.line())

    def rate(self) -> float:
        """Tokens per second since :meth:`start`."""
        dt = self.clock() - self._t0
        return self.done / dt if dt > 0 else 0.0

    def line(self) -> str:
        """One plain line: share done, tokens, rate and ETA."""
        rate = self.rate()
        frac = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta_s = "?" if eta != eta else f"{eta:,.0f}s"
        return f"{frac:6.1%} {self.done:,}/{self.total:,} tokens  {rate:,.0f} tok/s  ETA {eta_s}"

    def finish(self) -> None:
        """The run ended (done, or stopped at its deadline)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            log.info("prefill: done, %s", self.line())
