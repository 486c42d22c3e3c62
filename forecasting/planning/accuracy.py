"""Warm-up accuracy after the fact: was the plan right?

- precision: the share of planned prefixes that at least one request used in the period;
- recall: the share of the period's requests that began with a planned prefix.

Demand counts a request in every prefix it begins with (see
:mod:`forecasting.mining.demand`), so a request under two planned, nested prefixes must be
counted once: the requests covered are the counts of the planned prefixes that have no
planned ancestor (their request sets are disjoint, and hold every covered request).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import pandas as pd

from store.plan import Plan


@dataclass(frozen=True)
class WarmupAccuracy:
    """Precision and recall of a plan against what was asked for."""

    planned: int
    used: int
    requests: float
    covered: float

    @property
    def precision(self) -> float:
        """Planned prefixes used / planned (1.0 for an empty plan: nothing was wasted)."""
        return self.used / self.planned if self.planned else 1.0

    @property
    def recall(self) -> float:
        """Requests that began with a planned prefix / requests (1.0 when there were none)."""
        return self.covered / self.requests if self.requests else 1.0

    def to_json(self) -> dict[str, float]:
        return {"planned": self.planned, "used": self.used, "precision": self.precision,
                "requests": self.requests, "covered": self.covered, "recall": self.recall}


def planned_ids(plan: Plan | Iterable[str]) -> set[str]:
    """The prefix ids a plan names.

    Raises:
        ValueError: a plan entry has no ``prefix_id`` (hand-written plans need one to be scored).
    """
    if isinstance(plan, Plan):
        ids = set()
        for i, e in enumerate(plan.entries):
            if not e.prefix_id:
                raise ValueError(f"plan entry {i} (tenant {e.tenant!r}) has no prefix_id; it cannot be scored")
            ids.add(e.prefix_id)
        return ids
    return {str(p) for p in plan}


def warmup_accuracy(plan: Plan | Iterable[str], observed: pd.DataFrame, *, total_requests: float | None = None,
                    parents: Mapping[str, Any] | None = None, start: Any = None, end: Any = None) -> WarmupAccuracy:
    """Score a plan against the demand observed in the period ``[start, end)``.

    Args:
        plan: a :class:`store.plan.Plan` or the planned prefix ids.
        observed: per-prefix counts ``unique_id, ds, y`` in the period (e.g.
            ``Demand.series`` mined from the period's logs).
        total_requests: every request in the period (``Demand.total``'s sum). When
            ``None``, the requests under the observed root prefixes (those whose parent
            is not observed) are used: recall is then among requests with any candidate prefix.
        parents: ``unique_id -> parent unique_id or None`` (``Demand.prefixes``).
            Without it, prefixes are taken as not nested.
        start, end: restrict ``observed`` to this range of ``ds``.

    Raises:
        ValueError: ``observed`` lacks a column, or ``total_requests`` is below the covered count.
    """
    missing = {"unique_id", "ds", "y"} - set(observed.columns)
    if missing:
        raise ValueError(f"observed lacks column(s) {sorted(missing)}; expected (unique_id, ds, y)")
    obs = observed
    if start is not None:
        obs = obs[obs["ds"] >= pd.Timestamp(start)]
    if end is not None:
        obs = obs[obs["ds"] < pd.Timestamp(end)]
    counts = obs.groupby(obs["unique_id"].astype(str))["y"].sum()
    ids = planned_ids(plan)
    parent_of = {str(k): (str(v) if isinstance(v, str) else None) for k, v in (parents or {}).items()}

    def has_ancestor_in(pid: str, pool: set[str]) -> bool:
        p, seen = parent_of.get(pid), set()
        while p is not None and p not in seen:
            if p in pool:
                return True
            seen.add(p)
            p = parent_of.get(p)
        return False

    used = sum(1 for p in ids if counts.get(p, 0.0) > 0)
    covered = float(sum(counts.get(p, 0.0) for p in ids if not has_ancestor_in(p, ids)))
    if total_requests is None:
        observed_ids = set(counts.index)
        total = float(sum(v for p, v in counts.items() if not has_ancestor_in(p, observed_ids)))
    else:
        total = float(total_requests)
        if total + 1e-9 < covered:
            raise ValueError(f"total_requests ({total}) is below the requests under planned prefixes ({covered})")
    return WarmupAccuracy(planned=len(ids), used=used, requests=total, covered=covered)
