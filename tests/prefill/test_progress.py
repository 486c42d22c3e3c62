"""Prefill progress: a tqdm bar on a terminal, a log line every ``log_every_s`` seconds elsewhere."""
from __future__ import annotations

import io
import logging

from prefill.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_off_a_terminal_it_logs_plain_lines_at_the_interval_and_writes_nothing_to_the_stream(caplog) -> None:
    stream, clock = io.StringIO(), Clock()
    p = Progress(stream, log_every_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="prefill.progress"):
        p.start(1000)
        clock.t += 4.0
        p.advance(100)  # 4 s after the last line: no line yet
        clock.t += 6.0
        p.advance(150)  # 10 s: one line, rate over the whole run
        clock.t += 5.0
        p.advance(250)
        p.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["prefill: 1000 token(s) to compute",
                     "prefill:  25.0% 250/1,000 tokens  25 tok/s  ETA 30s",
                     "prefill: done,  50.0% 500/1,000 tokens  33 tok/s  ETA 15s"]
    assert stream.getvalue() == ""


def test_on_a_terminal_it_draws_a_tqdm_bar_with_the_token_counts_and_logs_nothing(caplog) -> None:
    stream = Terminal()
    p = Progress(stream)
    with caplog.at_level(logging.INFO, logger="prefill.progress"):
        p.start(2000)
        p.advance(500)
        p.advance(1500)
        p.finish()
    out = stream.getvalue()
    assert "prefill: 100%" in out and "2.00k/2.00k" in out and "tok/s" in out
    assert out.endswith("\n")  # the bar is closed: the next output starts on its own line
    assert not caplog.records
