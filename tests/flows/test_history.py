"""What earlier runs measured feeds the next: the LSH threshold (the write-up's rule) and the planner's prefill rate."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flows.history import DEFAULT_PREFILL_TOKENS_PER_S, choose_prefill_rate, choose_threshold
from prefill.rundir import RunDir


def make_run(root: Path, name: str, *, threshold: float | None, hits: int | None = None, lookups: int = 100,
             mtime: float, mine: str | None = None) -> Path:
    """A run directory as the flows leave it: mine.json, and the serving nodes' loader stats when measured."""
    d = root / name
    d.mkdir(parents=True)
    doc = {"prefixes": 3} if threshold is None else {"prefixes": 3, "similarity": {"threshold": threshold}}
    (d / "mine.json").write_text(mine if mine is not None else json.dumps(doc))
    if hits is not None:
        (d / "loader_stats").mkdir()
        (d / "loader_stats" / "node-1.json").write_text(json.dumps(
            {"lookups": lookups, "hits": hits, "tokens_served": 10 * hits, "prompt_tokens": 100 * lookups}))
    os.utime(d / "mine.json", (mtime, mtime))
    return d


def test_first_run_uses_the_config_and_a_parameter_pins_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "_flows" / "new")
    first = choose_threshold(run, 0.85)
    assert (first.threshold, first.source, first.from_run) == (0.85, "config", None)
    make_run(tmp_path / "_flows", "old", threshold=0.85, hits=10, mtime=1000)
    pinned = choose_threshold(run, 0.85, pinned=0.9)
    assert (pinned.threshold, pinned.source) == (0.9, "parameter")


def test_a_low_hit_rate_lowers_the_threshold_and_a_high_one_raises_it(tmp_path: Path) -> None:
    flows = tmp_path / "_flows"
    make_run(flows, "monday", threshold=0.85, hits=40, mtime=1000)  # 40 % of lookups hit: under 50 %
    low = choose_threshold(RunDir(flows / "tuesday"), 0.85)
    assert low.source == "adapted" and low.from_run == "monday" and low.hit_rate == pytest.approx(0.4)
    assert low.threshold == pytest.approx(0.85 * 0.9)
    assert "adapted from run monday's 0.85 by its measured hit rate 40.0%" in low.describe()
    # Tuesday mined at that threshold and served 90 % hits: Wednesday raises it by 10 %.
    make_run(flows, "tuesday", threshold=low.threshold, hits=90, mtime=2000)
    high = choose_threshold(RunDir(flows / "wednesday"), 0.85)
    assert high.from_run == "tuesday" and high.threshold == pytest.approx(0.85 * 0.9 * 1.1)
    # The bounds hold: 0.7 at the bottom, 0.95 at the top.
    make_run(flows, "thursday", threshold=0.72, hits=0, mtime=3000)
    assert choose_threshold(RunDir(flows / "friday"), 0.85).threshold == pytest.approx(0.7)
    make_run(flows, "friday", threshold=0.93, hits=99, mtime=4000)
    assert choose_threshold(RunDir(flows / "saturday"), 0.85).threshold == pytest.approx(0.95)


def test_runs_without_a_measurement_or_unreadable_are_passed_over(tmp_path: Path) -> None:
    flows = tmp_path / "_flows"
    make_run(flows, "measured", threshold=0.8, hits=20, mtime=1000)
    make_run(flows, "not-served-yet", threshold=0.9, mtime=2000)           # no loader stats yet
    make_run(flows, "before-recording", threshold=None, hits=80, mtime=3000)  # mined before thresholds were kept
    make_run(flows, "broken", threshold=0.9, mtime=4000, mine="{not json")
    bad = make_run(flows, "bad-stats", threshold=0.9, hits=50, mtime=5000)
    (bad / "loader_stats" / "node-2.json").write_text(json.dumps({"lookups": 3}))
    choice = choose_threshold(RunDir(flows / "new"), 0.85)
    assert choice.from_run == "measured" and choice.threshold == pytest.approx(0.8 * 0.9)
    assert [s.split(":")[0] for s in choice.skipped] == ["bad-stats", "broken"]
    assert "is not a KVLoader.stats() dump" in choice.skipped[0]
    assert choice.as_dict()["skipped"] == list(choice.skipped)
    # The run being mined never adapts from itself (a rerun of a measured run).
    assert choose_threshold(RunDir(flows / "measured"), 0.85).from_run != "measured"


def prefill_run(root: Path, name: str, *, model: str, rate: float, computed: int = 400, mtime: float,
                report: str | None = None) -> Path:
    """A run whose prefill measured ``rate`` tokens/s for ``model``."""
    d = root / name
    d.mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps({"kvwarm_plan": 1, "model": model, "entries": []}))
    (d / "prefill.json").write_text(report if report is not None else json.dumps(
        {"tokens_per_s": rate, "tokens_computed": computed, "seconds": computed / max(rate, 1e-9)}))
    os.utime(d / "prefill.json", (mtime, mtime))
    return d


def test_the_planner_budgets_with_the_last_measured_rate_of_the_same_model(tmp_path: Path) -> None:
    flows = tmp_path / "_flows"
    first = choose_prefill_rate(RunDir(flows / "new"), "kvwarm-tiny")
    assert (first.tokens_per_s, first.source) == (DEFAULT_PREFILL_TOKENS_PER_S, "default")
    prefill_run(flows, "old", model="kvwarm-tiny", rate=1800.0, mtime=1000)
    prefill_run(flows, "newer", model="kvwarm-tiny", rate=2400.0, mtime=2000)
    prefill_run(flows, "other-model", model="llama-8b", rate=30000.0, mtime=3000)
    prefill_run(flows, "nothing-computed", model="kvwarm-tiny", rate=0.0, computed=0, mtime=4000)
    prefill_run(flows, "broken", model="kvwarm-tiny", rate=0.0, mtime=5000, report="[1, 2]")
    got = choose_prefill_rate(RunDir(flows / "new"), "kvwarm-tiny")
    assert (got.tokens_per_s, got.source, got.from_run) == (2400.0, "measured", "newer")
    assert [s.split(":")[0] for s in got.skipped] == ["broken"]
    assert choose_prefill_rate(RunDir(flows / "new"), "llama-8b").tokens_per_s == 30000.0
    assert choose_prefill_rate(RunDir(flows / "new"), "kvwarm-tiny", 5000.0).source == "parameter"
    assert got.as_dict()["from_run"] == "newer"
