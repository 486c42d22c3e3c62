"""The live replay's targets on what kvwarm costs and saves against vLLM alone (bench/lib/live_figures.py)."""
from __future__ import annotations

import pytest

from bench.lib.live_figures import over_vllm


def _phase(mean: float | None, p99: float | None = None) -> dict:
    return {"ttft_mean_s": mean, "ttft_p99_s": p99}


def test_kvwarm_is_held_to_its_cost_before_the_event_and_its_savings_after() -> None:
    base = {"before": _phase(0.100), "after": _phase(0.200, 0.500)}  # 1.1 x is within 1.15 (float rounding aside)
    targets: dict = {}
    got = over_vllm({"before": _phase(0.110), "after": _phase(0.150, 0.900)}, base, targets)
    assert got == pytest.approx({"before_mean": 1.1, "after_mean": 0.75, "after_p99": 1.8})
    assert all(targets.values()) and len(targets) == 3
    targets = {}
    over_vllm({"before": _phase(0.120), "after": _phase(0.210, 1.100)}, base, targets)
    assert not any(targets.values())  # 1.2 x before, slower after, P99 2.2 x


def test_a_phase_without_figures_meets_nothing() -> None:
    targets: dict = {}
    got = over_vllm({"before": _phase(None), "after": _phase(None)}, {"before": _phase(0.1), "after": _phase(0.1, 0.2)},
                    targets)
    assert got == {"before_mean": None, "after_mean": None, "after_p99": None} and not any(targets.values())
