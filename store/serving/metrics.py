"""The loader's metrics: Prometheus collectors, and the same figures read back from them as a dict.

Every :class:`store.serving.loader.KVLoader` owns one :class:`LoaderMetrics`. By default it
registers its collectors in a fresh ``CollectorRegistry`` (so several loaders, and
tests, never collide); a serving process passes ``prometheus_client.REGISTRY`` (or its
own registry) to have them scraped with the rest of its metrics.

Each figure is kept once: in its collector. :meth:`LoaderMetrics.as_dict` (the loader's
``stats()``) reads the collectors back, and the latency percentiles come from the
histogram's buckets. Refusals of another tenant's namespace are counted once, by the
store that refuses them (:class:`store.tiers.stats.StoreStats`); the loader's
``refused_cross_tenant`` series reads that count.
"""
from __future__ import annotations

import logging
import math
import sqlite3
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from store.errors import StoreError
from store.miss import MissReason
from store.tiers.stats import StoreStats

log = logging.getLogger("kvwarm.loader")

#: Operations whose latency the histogram records (its ``stage`` label).
STAGES = ("lookup", "to_dynamic_cache", "copy_into_paged")

#: Buckets of the load-latency histogram (seconds): lookups are ~0.1-10 ms, loads more.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_REFUSED = "kvwarm_loader_refused_cross_tenant"


class _Refusals:
    """A collector exposing the store's count of refused cross-tenant attempts as the loader's counter."""

    def __init__(self, stats: StoreStats, tenant: str) -> None:
        self.stats = stats
        self.tenant = tenant

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(_REFUSED, "Refused attempts to reach another tenant's namespace.",
                                   labels=["tenant"])

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        family.add_metric([self.tenant], self.stats["refused"])
        yield family


def _samples(collector: Any, suffix: str) -> Iterator[tuple[dict[str, str], float]]:
    """``(labels, value)`` of a collector's samples named ``<name><suffix>``."""
    for family in collector.collect():
        for s in family.samples:
            if s.name == family.name + suffix:
                yield s.labels, s.value


def _number(v: float) -> int | float:
    return int(v) if float(v).is_integer() else v


def _upper_bound(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper edge of the bucket holding the ``q`` quantile of a histogram's samples
    (``buckets``: cumulative ``(le, count)``, ``+Inf`` last). Beyond the last finite
    bucket, that bucket's edge: read it as "at least"."""
    total = buckets[-1][1]
    rank = min(total, int(total * q) + 1)  # the sample a sorted list would give at index int(n * q)
    finite = [le for le, _ in buckets if not math.isinf(le)]
    for le, count in buckets:
        if count >= rank:
            return finite[-1] if math.isinf(le) else le
    return finite[-1]


class LoaderMetrics:
    """Counters, gauges and a histogram of one loader (thread-safe: the collectors are).

    Args:
        registry: where the Prometheus collectors register (default: a new registry).
        tenant: value of the ``tenant`` label on every series.
        store: the loader's store's counters (the refusals are counted there).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, tenant: str = "",
                 store: StoreStats) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tenant = tenant
        r, t = self.registry, ["tenant"]
        self._lookups = Counter("kvwarm_loader_lookups", "Lookups made.", t, registry=r)
        self._hits = Counter("kvwarm_loader_hits", "Lookups answered with a hit.", t, registry=r)
        self._miss = Counter("kvwarm_loader_misses", "Lookups without a hit, by reason.", [*t, "reason"],
                             registry=r)
        self._short = Counter("kvwarm_loader_hits_shortened", "Hits cut short of the stored prefix, by reason.",
                              [*t, "reason"], registry=r)
        self._tokens = Counter("kvwarm_loader_tokens_served", "Prompt tokens covered by hits.", t, registry=r)
        self._mapped = Counter("kvwarm_loader_bytes_mapped", "Snapshot bytes newly mapped by this process.", t,
                               registry=r)
        self._refused = _Refusals(store, tenant)
        r.register(self._refused)
        self._prefetch = Counter("kvwarm_loader_prefetch_blocks", "Blocks handled by prefetch, by outcome.",
                                 [*t, "outcome"], registry=r)
        self._pool_bytes = Gauge("kvwarm_pool_bytes_in_use", "Bytes of snapshots held in the node's shared pool.",
                                 registry=r)
        self._pool_budget = Gauge("kvwarm_pool_budget_bytes", "The node pool's byte budget.", registry=r)
        self._latency = Histogram("kvwarm_loader_load_seconds", "Latency of loader operations.", [*t, "stage"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        # Every series exists from the start, so dashboards see zeros, not gaps (and the
        # first request does not pay for creating them). The children are kept: the hot
        # path increments them without looking labels up.
        self._miss_by = {reason: self._miss.labels(tenant, reason.value) for reason in MissReason}
        self._short_by = {reason: self._short.labels(tenant, reason.value) for reason in MissReason}
        self._lookups_t, self._hits_t = self._lookups.labels(tenant), self._hits.labels(tenant)
        self._tokens_t, self._mapped_t = self._tokens.labels(tenant), self._mapped.labels(tenant)
        self._stage = {stage: self._latency.labels(tenant, stage) for stage in STAGES}

    def lookup(self) -> None:
        self._lookups_t.inc()

    def hit(self, tokens: int) -> None:
        self._hits_t.inc()
        self._tokens_t.inc(tokens)

    def miss(self, reason: MissReason) -> None:
        """Count a lookup that returned no hit, under its reason."""
        self._miss_by[reason].inc()

    def shortened(self, reason: MissReason) -> None:
        """Count a hit that stopped before a block the store holds (corrupt, expired, pool full...)."""
        self._short_by[reason].inc()

    def mapped(self, nbytes: int) -> None:
        self._mapped_t.inc(nbytes)

    def prefetched(self, outcome: str, n: int = 1) -> None:
        """Count ``n`` blocks prefetch found ``present``, ``fetched``, ``handed`` (to the node process,
        to copy) or ``mapped``, or left ``superseded`` (a newer prefetch replaced its own before it started them)."""
        self._prefetch.labels(self.tenant, outcome).inc(n)

    def pool(self, in_use: int, budget: int) -> None:
        self._pool_bytes.set(in_use)
        self._pool_budget.set(budget)

    def observe(self, stage: str, seconds: float) -> None:
        """Record the latency of one ``lookup``, ``to_dynamic_cache`` or ``copy_into_paged``."""
        self._stage[stage].observe(seconds)

    def as_dict(self) -> dict[str, Any]:
        """Every figure as plain numbers, read from the collectors: counters, misses by
        reason (those that happened), latency per stage (count, and the upper edges of the
        histogram buckets holding the p50 and p99: upper bounds of the true percentiles)."""
        out: dict[str, Any] = {}
        for key, collector in (("lookups", self._lookups), ("hits", self._hits), ("tokens_served", self._tokens),
                               ("bytes_mapped", self._mapped), ("refused_cross_tenant", self._refused)):
            out[key] = _number(sum(v for _, v in _samples(collector, "_total")))
        for labels, v in _samples(self._prefetch, "_total"):
            out[f"prefetch_{labels['outcome']}"] = _number(v)
        out["pool_bytes_in_use"] = _number(next(_samples(self._pool_bytes, ""))[1])
        out["pool_budget_bytes"] = _number(next(_samples(self._pool_budget, ""))[1])
        for key, collector in (("misses_by_reason", self._miss), ("shortened_by_reason", self._short)):
            out[key] = {labels["reason"]: _number(v) for labels, v in _samples(collector, "_total") if v}
        out["misses"] = sum(out["misses_by_reason"].values())
        buckets: dict[str, list[tuple[float, float]]] = {}
        for labels, v in _samples(self._latency, "_bucket"):
            buckets.setdefault(labels["stage"], []).append((float(labels["le"]), v))
        out["latency"] = {}
        for stage, cum in buckets.items():
            cum.sort()
            if cum[-1][1]:
                out["latency"][stage] = {"count": int(cum[-1][1]), "p50_s": _upper_bound(cum, 0.5),
                                         "p99_s": _upper_bound(cum, 0.99)}
        return out


def loader_stats(loader: Any) -> dict[str, Any]:
    """A :class:`store.serving.loader.KVLoader`'s figures as a dict: its metrics (:meth:`LoaderMetrics.as_dict`),
    its pool's state, and whether it works through the node process (``node``: the node's pid or ``None``;
    ``node_fallbacks``: calls that worked alone while the node was away)."""
    out = loader.metrics.as_dict()
    try:
        out.update(pool_bytes_in_use=loader.pool.usage(), pool_budget_bytes=loader.pool.budget(),
                   pool_pinned_bytes=loader.pool.pinned_bytes(), pool_instances=len(loader.pool.instances()))
    except (sqlite3.Error, StoreError) as exc:
        log.warning("pool state unavailable: %s", exc)
    client = loader.node.client
    out.update(attached=loader.pool.attached, pool_private=loader.pool.private, fetch_mode=loader.fetch_mode,
               s3_backoff=loader.fetcher.has_remote and not loader.fetcher.usable(), mapped_here=len(loader.mapper),
               bookkeeping_unwritten=sum(t.bookkeeping_unwritten() for t in loader.store.tiers),
               store=loader.store.stats.as_dict(), fleet=loader.fleet.stats.as_dict() if loader.fleet else {},
               node=client.node.get("pid") if client is not None else None, node_fallbacks=loader.node.fallbacks)
    return out
