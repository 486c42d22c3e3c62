"""The store bench's paired timing: untimed warm-up, ours and raw alternating first, medians as MB/s."""
from __future__ import annotations

from bench.lib.paired import Pair, Timer, alternate, summarise


def test_alternate_drops_the_warm_up_and_swaps_which_goes_first():
    calls: list[str] = []
    times = iter(range(1, 100))

    def op(name):
        def run() -> float:
            calls.append(name)
            return float(next(times))
        return run

    pair = alternate(3, op("ours"), op("raw"), warmup=1)
    assert calls == ["ours", "raw", "raw", "ours", "ours", "raw", "raw", "ours"]
    assert pair.ours == [4.0, 5.0, 8.0] and pair.raw == [3.0, 6.0, 7.0]  # the first pair (1, 2) is not kept


def test_summarise_gives_the_ratio_of_throughputs_of_medians_and_of_minima():
    r = summarise(Pair(ours=[2.0, 1.0, 4.0], raw=[1.0, 0.5, 1.0]), nbytes=4_000_000)
    assert (r["ours_mb_s"], r["raw_mb_s"], r["ratio"], r["ratio_of_min"]) == (2.0, 4.0, 0.5, 0.5)
    assert r["ours_s"] == [2.0, 1.0, 4.0]


def test_timer_runs_the_preparation_untimed_and_returns_seconds():
    prepared: list[bool] = []
    assert Timer(warm_bytes=1 << 16).timed(lambda: None, lambda: prepared.append(True)) >= 0.0
    assert prepared == [True]
