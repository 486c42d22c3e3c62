"""Plans at a short cadence: the plan the pipeline ships every few minutes, and the one the replay measures.

:func:`plan_now` makes the whole decision from the logs before a time ``as_of``:

1. the logs of the ``lookback_s`` before ``as_of`` are mined, or the last
   ``lookback_requests`` before it when the lookback holds fewer (after an idle night the
   plan still learns from the traffic before it)
   (:func:`forecasting.mining.request_tree.mine_requests`; nothing at or after ``as_of``);
2. the reuse model is fitted on them (:class:`forecasting.planning.reuse.ReuseModel`):
   each stored prefix's expected uses in the coming horizon;
3. the stored prefixes worth a place on a serving node are chosen under the node and
   store bytes budgets (:mod:`forecasting.planning.retain`);
4. they join the prefill entries of the latest off-peak plan (``base``: what
   :func:`forecasting.planning.planner.make_plan` chose from the demand forecasts) in one
   plan, most valuable first: one value model ranks both
   (:func:`forecasting.planning.planner.prefix_value`); then the places the ``retain``
   entries hold in that order are given to them by urgency, most urgent first (the
   expected uses in the reuse model's ``urgent_s``; ties by value), so a loader copies
   what is needed soonest first. The prefill entries keep their places and order.

The cadence flow (``flows/cadence.py``) calls it every ``cadence_minutes`` and on demand;
``prefill simulate`` and ``bench/replay_bench.py`` call it at the same cadence, each time
from the trace before the plan's time. What the replay measures is what ships.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd

from forecasting.mining.prefix_tree import Tokenizer, one_model
from forecasting.mining.request_tree import mine_requests
from forecasting.planning.planner import PlanCosts
from forecasting.planning.retain import Present, RetainBudget, retain_entries, retain_nodes
from forecasting.planning.reuse import Occurrences, ReuseConfig, ReuseModel
from store.errors import BadInputError
from store.identity.keys import KeyRoot
from store.plan import Plan

#: the default cadence of short plans (the cadence flow's parameter)
CADENCE_MINUTES = 5.0


@dataclass(frozen=True)
class CadenceSpec:
    """What a short-cadence plan learns from and may spend.

    Attributes:
        budget: bytes a plan may retain (on a serving node's tier, in the store).
        reuse: the reuse model's knobs.
        lookback_s: the logs before ``as_of`` it learns from.
        min_value: a retained block must be worth more than this (GPU-seconds).
        lookback_requests: when the lookback holds fewer requests than this, the plan learns
            from the last this many before ``as_of`` instead, however old (0: never).
        urgent_first: give the ``retain`` entries' places to them by urgency (step 4);
            ``False``: by value, as the loader's retention ranks them.
    """

    budget: RetainBudget
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    lookback_s: float = 3600.0
    min_value: float = 0.0
    lookback_requests: int = 2000
    urgent_first: bool = True

    def __post_init__(self) -> None:
        if not (self.lookback_s > 0 and math.isfinite(self.lookback_s)):
            raise BadInputError(f"CadenceSpec.lookback_s must be a positive number of seconds, got {self.lookback_s!r}")
        if not (isinstance(self.lookback_requests, int) and self.lookback_requests >= 0):
            raise BadInputError(f"CadenceSpec.lookback_requests must be an integer >= 0, got {self.lookback_requests!r}")


def unix_s(when: Any) -> float:
    """A tz-naive UTC timestamp (or anything ``pd.Timestamp`` takes) in Unix seconds."""
    ts = pd.Timestamp(when)
    if ts.tzinfo is not None:
        ts = ts.tz_convert("UTC").tz_localize(None)
    return ts.value / 1e9


def plan_now(requests: pd.DataFrame, as_of: Any, *, cost: PlanCosts, spec: CadenceSpec, block_size: int,
             roots: KeyRoot | Mapping[str, KeyRoot] | None = None, tokenizer: Tokenizer | None = None,
             model: str | None = None, present: Present | None = None, base: Plan | None = None,
             created_at: float | None = None) -> Plan:
    """The plan at ``as_of`` from the logs before it (see the module docstring).

    Args:
        requests: log rows (:func:`forecasting.ingest.logs.read_logs`'s columns); rows at
            or after ``as_of`` are never read.
        as_of: the plan's time (tz-naive UTC).
        cost, spec: prices and budgets.
        block_size, roots, tokenizer, model: how the logs are mined
            (:func:`forecasting.mining.request_tree.mine_requests`); with ``model``, only its
            rows are read (the lookback and ``extra["requests"]`` count them; a model the log
            does not hold gives a plan that learned from 0 requests).
        present: which mined prefixes the store holds (default: all of them, as when the
            engines write their KV back).
        base: the latest off-peak plan, whose prefill entries this plan keeps.

    Returns:
        A version-2 plan: ``retain`` entries and ``base``'s prefill entries by score, the
        ``retain`` entries' places then by urgency, ``as_of`` set; ``extra`` says what the
        reuse model learned from (``read_s``: the seconds of logs it read, when more than the lookback),
        its horizon (``horizon_s``) and, once it has learned, ``fleet_reuse``: the table a node
        agent ranks the fleet's records with.
    """
    t = unix_s(as_of)
    if model is not None:  # the model's own requests: what the lookback counts and the plan learns from
        requests = one_model(requests, model)
    secs = pd.to_datetime(requests["timestamp"]).to_numpy(dtype="datetime64[us]").astype(np.int64) / 1e6
    before = secs < t
    since = t - spec.lookback_s
    if int((before & (secs >= since)).sum()) < spec.lookback_requests:
        past = np.sort(secs[before])
        if len(past):
            since = min(since, float(past[max(len(past) - spec.lookback_requests, 0)]))
    keep = before & (secs >= since)
    rows = requests[keep].iloc[np.argsort(secs[keep], kind="stable")]
    entries: list[Any] = []
    extra: dict[str, Any] = {"requests": int(len(rows)), "lookback_s": spec.lookback_s}
    if since < t - spec.lookback_s:
        extra["read_s"] = round(t - since, 3)
    if len(rows):
        tree = mine_requests(rows, block_size=block_size, tokenizer=tokenizer, roots=roots, model=model)
        occ = Occurrences.of(tree)
        reuse = ReuseModel.fit(occ, t, spec.reuse)
        uses = reuse.expected_uses(occ)
        held = None if present is None else present(tree, np.arange(tree.n_nodes))
        chosen, rank = retain_nodes(tree, uses, cost, spec.budget, horizon_s=spec.reuse.horizon_s, present=held,
                                    min_value=spec.min_value)
        entries = retain_entries(tree, uses, chosen, rank, reuse.urgency(occ))
        extra.update(reuse={"fallback": reuse.fallback, "closed_outcomes": reuse.closed},
                     retain_blocks=int(len(chosen)), retain_bytes=float(len(chosen) * cost.bytes(block_size)),
                     horizon_s=spec.reuse.horizon_s)
        curve = reuse.fleet_curve()
        if curve is not None:  # how a node agent ranks the fleet's records (docs/guides/loader.md)
            extra["fleet_reuse"] = curve
    kept = {e.prefix_id for e in entries}
    prefill = [e for e in (base.prefill_entries() if base is not None else []) if e.prefix_id not in kept]
    merged = sorted(prefill + entries, key=lambda e: -e.score)
    urgent = iter(sorted(entries, key=lambda e: (-(e.urgency or 0.0), -e.score)))
    if spec.urgent_first:
        merged = [next(urgent) if e.action == "retain" else e for e in merged]
    return Plan(entries=tuple(merged), created_at=time.time() if created_at is None else created_at,
                block_size=block_size, model=model,
                window_start=None if base is None else base.window_start,
                window_end=None if base is None else base.window_end, extra=extra, as_of=t)
