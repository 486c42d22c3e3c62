"""What earlier runs of a store measured feeds the next run: the LSH threshold and the prefill rate.

Runs live side by side (:meth:`prefill.rundir.RunDir.others`); each records what it used and,
once served, what it achieved. Two knobs of a new run come from there unless its flow
parameters pin them:

- :func:`choose_threshold`, the MinHash LSH threshold mining groups prompts with. The
  SageMaker write-up's rule (:func:`forecasting.mining.families.adapt_threshold`): when the
  measured hit rate is under 50 %, families were too strict to find shared prefixes, so
  the next run lowers the threshold by 10 % (not below 0.7); otherwise it raises it by
  10 % (not above 0.95). Each run records its threshold in ``mine.json``
  (``similarity``); serving nodes leave their loader stats dumps in
  ``<run>/loader_stats/`` (the demo's replay does), from which the monitoring computes
  the run's request hit rate; a new run adapts the threshold of the most recent earlier
  run that has one. Else the config's ``kv_cache.similarity_threshold``.
- :func:`choose_prefill_rate`, the prefill tokens/s the planner budgets GPU seconds
  with: the rate the most recent earlier prefill of the same model measured
  (``prefill.json``), else :data:`DEFAULT_PREFILL_TOKENS_PER_S`.

An earlier run whose files cannot be read is skipped and named in the choice: an old
directory never stops a run.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from flows.report import monitoring_summary
from forecasting.mining.families import adapt_threshold
from prefill.monitoring import MonitoringError
from prefill.rundir import RunDir

#: the planner's prefill rate when no earlier run of the model measured one (tokens/s)
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0


def _earlier(run: RunDir, stage: str) -> list[RunDir]:
    """The store's other runs that have ``stage``'s result file, most recently written first."""
    found: list[tuple[float, RunDir]] = []
    for d in run.others():
        try:
            found.append((d.result(stage).stat().st_mtime, d))
        except OSError:  # not a run of that stage (or removed meanwhile)
            continue
    return [d for _, d in sorted(found, key=lambda x: x[0], reverse=True)]


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


def _measured(run: RunDir) -> tuple[float, float] | None:
    """(threshold mined with, measured request hit rate) of an earlier run, or None when it has none."""
    if not run.mine.is_file():
        return None
    recorded = json.loads(run.mine.read_text()).get("similarity")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("threshold"), (int, float)):
        return None  # mined before thresholds were recorded: nothing to adapt from
    rate = monitoring_summary(run)["cache_efficiency"].get("request_hit_rate")
    return None if rate is None else (float(recorded["threshold"]), float(rate))


def choose_threshold(run: RunDir, configured: float, pinned: float | None = None) -> ThresholdChoice:
    """The threshold run ``run`` mines with (see the module docstring).

    Earlier runs are the store's other runs (:meth:`prefill.rundir.RunDir.others`),
    most recently mined first.
    """
    if pinned is not None:
        return ThresholdChoice(float(pinned), "parameter")
    skipped: list[str] = []
    for d in _earlier(run, "mine"):
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


@dataclass(frozen=True)
class RateChoice:
    """The prefill rate a plan budgets with, and why (recorded in the plan's ``extra.prefill_rate``)."""

    tokens_per_s: float
    source: str  # "parameter", "measured" or "default"
    from_run: str | None = None
    skipped: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {**asdict(self), "skipped": list(self.skipped)}


def _measured_rate(run: RunDir, model: str) -> float | None:
    """The tokens/s an earlier run's prefill measured for ``model``, or None (other model, nothing computed)."""
    plan = json.loads(run.plan.read_text()) if run.plan.is_file() else {}
    if not isinstance(plan, dict) or plan.get("model") != model:
        return None
    report = json.loads(run.prefill.read_text())
    rate, computed = report.get("tokens_per_s"), report.get("tokens_computed")
    ok = isinstance(rate, (int, float)) and rate > 0 and isinstance(computed, (int, float)) and computed > 0
    return float(rate) if ok else None


def choose_prefill_rate(run: RunDir, model: str, given: float | None = None) -> RateChoice:
    """The prefill tokens/s run ``run`` plans with: ``given``, else the last measured for ``model``, else the default."""
    if given is not None:
        return RateChoice(float(given), "parameter")
    skipped: list[str] = []
    for d in _earlier(run, "prefill"):
        try:
            rate = _measured_rate(d, model)
        except (OSError, ValueError, AttributeError) as exc:
            skipped.append(f"{d.name}: {exc}")
            continue
        if rate is not None:
            return RateChoice(rate, "measured", d.name, tuple(skipped))
    return RateChoice(DEFAULT_PREFILL_TOKENS_PER_S, "default", skipped=tuple(skipped))
