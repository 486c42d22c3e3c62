"""The MinHash LSH threshold a run mines with: pinned, adapted from the last measured run, or configured.

The SageMaker write-up's rule (:func:`forecasting.families.adapt_threshold`): when the
measured hit rate is under 50 %, families were too strict to find shared prefixes, so
the next run lowers the threshold by 10 % (not below 0.7); otherwise it raises it by
10 % (not above 0.95). The loop runs across pipeline runs of one store:

- each run records the threshold it mined with in its ``mine.json`` (``similarity``);
- serving nodes leave their loader stats dumps in ``<run>/loader_stats/`` (the demo's
  replay does), from which the monitoring computes the run's request hit rate;
- a new run takes the most recent earlier run of the store that has a measured hit rate,
  and adapts that run's threshold by it.

A ``similarity`` flow parameter pins the threshold (no adaptation); with no measured run
the config's ``kv_cache.similarity_threshold`` is used. An earlier run whose files cannot
be read is skipped, and the choice says so: an old directory never stops mining.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flows.report import monitoring_summary
from forecasting.families import adapt_threshold
from prefill.monitoring import MonitoringError


@dataclass(frozen=True)
class ThresholdChoice:
    """The threshold a run mines with, and why (recorded in its ``mine.json`` as ``similarity``)."""

    threshold: float
    source: str  # "parameter", "adapted" or "config"
    from_run: str | None = None
    from_threshold: float | None = None
    hit_rate: float | None = None
    skipped: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {**asdict(self), "skipped": list(self.skipped)}

    def describe(self) -> str:
        """One line for the run's log."""
        if self.source == "adapted":
            return (f"similarity threshold {self.threshold:.4g}: adapted from run {self.from_run}'s "
                    f"{self.from_threshold:.4g} by its measured hit rate {self.hit_rate:.1%}")
        return f"similarity threshold {self.threshold:.4g} ({self.source})"


def _measured(run_dir: Path) -> tuple[float, float] | None:
    """(threshold mined with, measured request hit rate) of an earlier run, or None when it has none."""
    mine = run_dir / "mine.json"
    if not mine.is_file():
        return None
    recorded = json.loads(mine.read_text()).get("similarity")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("threshold"), (int, float)):
        return None  # mined before thresholds were recorded: nothing to adapt from
    rate = monitoring_summary(run_dir)["cache_efficiency"].get("request_hit_rate")
    return None if rate is None else (float(recorded["threshold"]), float(rate))


def choose_threshold(run_dir: Path, configured: float, pinned: float | None = None) -> ThresholdChoice:
    """The threshold run ``run_dir`` mines with (see the module docstring).

    Earlier runs are the other directories beside ``run_dir`` (``<local tier>/_flows/``),
    most recently mined first.
    """
    if pinned is not None:
        return ThresholdChoice(float(pinned), "parameter")
    skipped: list[str] = []
    root = run_dir.parent
    earlier = [d for d in root.iterdir() if d.is_dir() and d.name != run_dir.name and (d / "mine.json").is_file()] \
        if root.is_dir() else []
    for d in sorted(earlier, key=lambda d: (d / "mine.json").stat().st_mtime, reverse=True):
        try:
            found = _measured(d)
        except (MonitoringError, OSError, ValueError) as exc:
            skipped.append(f"{d.name}: {exc}")
            continue
        if found is not None:
            used, rate = found
            return ThresholdChoice(adapt_threshold(used, min(max(rate, 0.0), 1.0)), "adapted", d.name, used, rate,
                                   tuple(skipped))
    return ThresholdChoice(float(configured), "config", skipped=tuple(skipped))
