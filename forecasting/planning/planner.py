"""The prewarm plan: which prefixes to prefill tonight, in what order, with what TTL.

One value model ranks everything a plan decides (:func:`prefix_value`), prefixes to
prefill here and stored prefixes to retain (:mod:`forecasting.planning.retain`):

    value = expected hits x prefill seconds one hit saves
            - the cost of having it: prefill seconds to compute it when it is absent,
              or the GPU-seconds its fetch is priced at when it is stored
            - storage cost (bytes x TTL, priced in GPU-seconds)

For a prefix to prefill, the hits are over the *target period* (from the end of the
off-peak window for the prefix's TTL). Prefill seconds are :class:`store.cost.PrefillCost`'s
(linear tokens plus attention's quadratic term, the one model the simulator and the
serving side use too); storage is priced in GPU-seconds per GiB-hour and a fetch from
the store in GPU-seconds per GiB, policies of the planner's own.

A request gets the *longest* prewarmed prefix it begins with. So a prefix whose
ancestor (``prefixes.parent``) is already planned saves only its extra tokens, and an
ancestor of a planned prefix serves only the requests that do not go on to that
prefix. Selection is lazy greedy by value per unit of budget (GPU-seconds and store
bytes, each as a fraction of its budget), recomputing a candidate's marginal value
when it reaches the top. The plan lists the chosen prefixes by value, most valuable
first: the prefill job works down the list and stops at its deadline.

TTL: the forecast says until when a prefix is likely to be asked for (the last bucket
whose probability of a request is at least ``ttl_p``); the TTL runs to there from
the window's end, clamped to the configured bounds
(:meth:`store.config.KvCacheConfig.clamp_ttl`: ``kv_cache.ttl_min_hours`` .. ``ttl_max_hours``).
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd

from store.config import KvCacheConfig
from store.cost import PrefillCost
from store.plan import Plan, PlanEntry


class DemandLike(Protocol):
    """What the planner reads of :class:`forecasting.mining.demand.Demand`: the ``prefixes`` table."""

    prefixes: pd.DataFrame


@dataclass(frozen=True)
class PlanCosts:
    """What a planned prefix costs, in GPU-seconds: its prefill, and keeping its KV.

    Attributes:
        prefill: prefill time on the prefill GPU (e.g. ``PrefillCost().scaled(measured tokens/s)``).
        bytes_per_token: KV bytes stored per token (:func:`store.format.payload.kv_bytes_per_token`).
        gpu_s_per_gib_hour: price of keeping 1 GiB for an hour, in GPU-seconds.
        gpu_s_per_gib_fetched: price of copying 1 GiB from the store to a serving node, in
            GPU-seconds (what the bandwidth a prefetch takes is worth).
    """

    prefill: PrefillCost
    bytes_per_token: float
    gpu_s_per_gib_hour: float = 0.5
    gpu_s_per_gib_fetched: float = 0.05

    def __post_init__(self) -> None:
        if not (isinstance(self.bytes_per_token, (int, float)) and self.bytes_per_token > 0
                and math.isfinite(self.bytes_per_token)):
            raise ValueError(f"PlanCosts.bytes_per_token must be a positive number, got {self.bytes_per_token!r}")
        for name in ("gpu_s_per_gib_hour", "gpu_s_per_gib_fetched"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"PlanCosts.{name} must be >= 0, got {value!r}")

    def bytes(self, n_tokens: float) -> float:
        return n_tokens * self.bytes_per_token

    def storage_s(self, n_tokens: float, ttl_s: float) -> float:
        """Storage cost in GPU-seconds of ``n_tokens`` of KV kept ``ttl_s``."""
        return self.bytes(n_tokens) / 2**30 * ttl_s / 3600.0 * self.gpu_s_per_gib_hour

    def fetch_s(self, n_tokens: float) -> float:
        """The price in GPU-seconds of copying ``n_tokens`` of stored KV to a serving node."""
        return self.bytes(n_tokens) / 2**30 * self.gpu_s_per_gib_fetched


def prefix_value(hits: Any, saved_s: Any, n_tokens: Any, ttl_s: Any, cost: PlanCosts, *, present: bool) -> Any:
    """The one value model: ``hits * saved_s`` minus having the prefix and keeping it ``ttl_s``.

    Having it costs its prefill when it is absent (``present=False``: a prefix to prefill)
    and its fetch when it is stored (``present=True``: a prefix to retain). Numbers or
    numpy arrays, elementwise; ``n_tokens`` are the tokens to compute or fetch, ``saved_s``
    the prefill seconds one hit saves.
    """
    have = cost.fetch_s(n_tokens) if present else cost.prefill.seconds(n_tokens)
    return hits * saved_s - have - cost.storage_s(n_tokens, ttl_s)


@dataclass(frozen=True)
class Budget:
    """What tonight's prefill may spend: GPU-seconds (window x GPUs x utilisation) and store bytes."""

    gpu_s: float
    store_bytes: float

    def __post_init__(self) -> None:
        for name in ("gpu_s", "store_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"Budget.{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class PlanPolicy:
    """Knobs of the plan. TTLs are clamped by ``kv_cache`` (:meth:`store.config.KvCacheConfig.clamp_ttl`)."""

    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    ttl_p: float = 0.5
    min_value: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.ttl_p <= 1.0:
            raise ValueError(f"ttl_p must be in (0, 1], got {self.ttl_p!r}")


@dataclass(frozen=True)
class Candidate:
    """One prefix as the planner sees it (see :func:`candidates_from`)."""

    prefix_id: str
    tenant: str
    n_tokens: int
    expected_hits: float
    ttl_s: float
    parent: str | None
    family: str | None
    token_ids: tuple[int, ...] | None
    text: str | None


def _ts(value: Any) -> pd.Timestamp:
    return pd.Timestamp(value)


def candidates_from(demand: DemandLike, forecast: pd.DataFrame, target_start: Any, policy: PlanPolicy,
                    bucket: pd.Timedelta) -> tuple[list[Candidate], int]:
    """Join the prefixes with their forecasts; TTL and expected hits per prefix.

    ``forecast`` is a long table ``unique_id, ds, y_hat, p_any`` covering the target
    period. Returns the candidates and how many prefixes were skipped because they
    have neither token ids nor text (a plan entry needs one).
    """
    missing = {"unique_id", "ds", "y_hat", "p_any"} - set(forecast.columns)
    if missing:
        raise ValueError(f"forecast lacks column(s) {sorted(missing)}; use forecasting.models.selection.forecast_frame")
    start = _ts(target_start)
    fc = forecast[forecast["ds"] >= start - bucket + pd.Timedelta(1)].sort_values(["unique_id", "ds"])
    by_id = {uid: g for uid, g in fc.groupby("unique_id", sort=False)}
    out: list[Candidate] = []
    skipped = 0
    for row in demand.prefixes.itertuples(index=False):
        g = by_id.get(row.unique_id)
        if g is None:
            continue
        tokens = getattr(row, "token_ids", None)
        text = getattr(row, "text", None)
        tokens = tuple(int(t) for t in tokens) if tokens is not None and len(tokens) else None
        text = text if isinstance(text, str) and text else None
        if tokens is None and text is None:
            skipped += 1
            continue
        ends = pd.DatetimeIndex(g["ds"]) + bucket
        likely = ends[g["p_any"].to_numpy() >= policy.ttl_p]
        want = (likely.max() - start).total_seconds() if len(likely) else 0.0
        ttl = policy.kv_cache.clamp_ttl(want)
        # expected hits: the forecast mass inside [start, start + ttl), partial buckets pro rata
        lo = (pd.DatetimeIndex(g["ds"]) - start).total_seconds().to_numpy()
        width = bucket.total_seconds()
        overlap = np.clip(np.minimum(lo + width, ttl) - np.maximum(lo, 0.0), 0.0, width) / width
        hits = float(np.sum(g["y_hat"].to_numpy() * overlap))
        parent = getattr(row, "parent", None)
        family = getattr(row, "family", None)
        out.append(Candidate(str(row.unique_id), str(row.tenant), int(row.n_tokens), hits, ttl,
                             parent if isinstance(parent, str) else None, family if isinstance(family, str) else None,
                             tokens, None if tokens is not None else text))  # exact token ids win over text
    return out, skipped


@dataclass(frozen=True)
class Choice:
    """A chosen prefix with its marginal value and what it costs."""

    candidate: Candidate
    value: float
    gpu_s: float
    store_bytes: float


def _marginal(c: Candidate, chosen: dict[str, Candidate], ancestors: dict[str, list[str]],
              descendants: dict[str, list[str]], cost: PlanCosts) -> float:
    # Longest-prefix serving: an ancestor already planned serves these requests with
    # fewer tokens, so only the extra tokens are saved; planned descendants take their
    # own requests away from this prefix.
    base = next((a for a in ancestors.get(c.prefix_id, ()) if a in chosen), None)
    saved_per_hit = cost.prefill.seconds(c.n_tokens, chosen[base].n_tokens if base else 0)
    taken = sum(chosen[d].expected_hits for d in descendants.get(c.prefix_id, ())
                if d in chosen and not any(a in chosen for a in _between(d, c.prefix_id, ancestors)))
    hits = max(c.expected_hits - taken, 0.0)
    return float(prefix_value(hits, saved_per_hit, c.n_tokens, c.ttl_s, cost, present=False))


def _between(desc: str, anc: str, ancestors: dict[str, list[str]]) -> list[str]:
    """The candidate ancestors of ``desc`` strictly below ``anc``."""
    chain = ancestors.get(desc, [])
    return chain[:chain.index(anc)] if anc in chain else chain


def select(cands: list[Candidate], cost: PlanCosts, budget: Budget, *, min_value: float = 0.0) -> list[Choice]:
    """Lazy-greedy choice under both budgets; returns choices in value order (highest first).

    Raises:
        ValueError: two candidates share a ``prefix_id``.
    """
    by_id: dict[str, Candidate] = {}
    for c in cands:
        if c.prefix_id in by_id:
            raise ValueError(f"prefix {c.prefix_id!r} appears twice among the candidates")
        by_id[c.prefix_id] = c
    ancestors: dict[str, list[str]] = {}
    for c in cands:  # nearest first, over planned-candidate ancestors only
        chain, p, seen = [], c.parent, set()
        while p is not None and p not in seen:
            seen.add(p)
            if p in by_id:
                chain.append(p)
            p = by_id[p].parent if p in by_id else None
        ancestors[c.prefix_id] = chain
    descendants: dict[str, list[str]] = {}
    for d, chain in ancestors.items():
        for a in chain:
            descendants.setdefault(a, []).append(d)

    def density(c: Candidate, value: float) -> float:
        use = (cost.prefill.seconds(c.n_tokens) / budget.gpu_s if budget.gpu_s > 0 else math.inf) + \
              (cost.bytes(c.n_tokens) / budget.store_bytes if budget.store_bytes > 0 else math.inf)
        return value / use if use > 0 else math.inf

    chosen: dict[str, Candidate] = {}
    result: list[Choice] = []
    heap = [(-density(c, v), c.prefix_id, v) for c in cands
            if (v := _marginal(c, {}, ancestors, descendants, cost)) > min_value]
    heapq.heapify(heap)
    gpu_left, bytes_left = budget.gpu_s, budget.store_bytes
    while heap:
        _, pid, stale = heapq.heappop(heap)
        c = by_id[pid]
        value = _marginal(c, chosen, ancestors, descendants, cost)
        if value != stale:  # lazy greedy: re-queue with the current marginal value
            if value > min_value:
                heapq.heappush(heap, (-density(c, value), pid, value))
            continue
        g, b = cost.prefill.seconds(c.n_tokens), cost.bytes(c.n_tokens)
        if g > gpu_left or b > bytes_left:
            continue
        chosen[pid] = c
        gpu_left -= g
        bytes_left -= b
        result.append(Choice(c, value, g, b))
    result.sort(key=lambda ch: (-ch.value, ch.candidate.prefix_id))
    return result


def make_plan(demand: DemandLike, forecast: pd.DataFrame, *, cost: PlanCosts, budget: Budget,
              window_start: Any, window_end: Any, bucket: pd.Timedelta, policy: PlanPolicy = PlanPolicy(),
              model: str | None = None, block_size: int | None = None, created_at: float | None = None) -> Plan:
    """The prewarm plan for the off-peak window ``[window_start, window_end)``.

    Args:
        demand: mined demand (its ``prefixes`` table: ``unique_id, tenant, n_tokens,
            token_ids, text`` and optionally ``family``, ``parent``).
        forecast: per-prefix forecast ``unique_id, ds, y_hat, p_any`` reaching past
            the window (see :func:`forecasting.models.parallel.forecast_frame_parallel`).
        cost, budget, policy: see :class:`PlanCosts`, :class:`Budget`, :class:`PlanPolicy`.
        window_start, window_end: the off-peak window (Timestamps, tz-naive UTC); the
            target period starts at its end.
        bucket: the forecast's bucket length.

    Returns:
        A :class:`store.plan.Plan`, entries most valuable first; ``extra`` records the
        budgets, what was spent, the KV bytes per token it was priced at (``prefill report``
        reads them) and how many prefixes had no tokens or text.
    """
    start, end = _ts(window_start), _ts(window_end)
    if end <= start:
        raise ValueError(f"window end {end} is not after its start {start}")
    cands, skipped = candidates_from(demand, forecast, end, policy, bucket)
    chosen = select(cands, cost, budget, min_value=policy.min_value)
    entries = tuple(
        PlanEntry(tenant=ch.candidate.tenant, token_ids=ch.candidate.token_ids, text=ch.candidate.text,
                  ttl_s=ch.candidate.ttl_s, score=round(ch.value, 6), expected_hits=round(ch.candidate.expected_hits, 6),
                  family=ch.candidate.family, prefix_id=ch.candidate.prefix_id)
        for ch in chosen)
    extra = {"budget_gpu_s": budget.gpu_s, "budget_store_bytes": budget.store_bytes,
             "planned_gpu_s": float(sum(ch.gpu_s for ch in chosen)),
             "planned_store_bytes": float(sum(ch.store_bytes for ch in chosen)),
             "kv_bytes_per_token": float(cost.bytes_per_token), "candidates": len(cands), "skipped_without_tokens": skipped}
    unix = lambda t: (t - pd.Timestamp("1970-01-01")).total_seconds()  # noqa: E731 - tz-naive UTC
    return Plan(entries=entries, created_at=time.time() if created_at is None else created_at, block_size=block_size,
                model=model, window_start=unix(start), window_end=unix(end), extra=extra)
