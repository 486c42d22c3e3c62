"""The loader's metrics: Prometheus collectors plus the same figures as a plain dict.

Every :class:`store.serving.loader.KVLoader` owns one :class:`LoaderMetrics`. By default it
registers its collectors in a fresh ``CollectorRegistry`` (so several loaders, and
tests, never collide); a serving process passes ``prometheus_client.REGISTRY`` (or its
own registry) to have them scraped with the rest of its metrics.
"""
from __future__ import annotations

import threading
from collections import Counter as _Counts
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from store.miss import MissReason

#: Why a lookup (or part of one) was not served (the label values of ``reason``).
MISS_REASONS: tuple[str, ...] = tuple(r.value for r in MissReason)

#: Operations whose latency the histogram records (its ``stage`` label).
STAGES = ("lookup", "to_dynamic_cache", "copy_into_paged")

#: Buckets of the load-latency histogram (seconds): lookups are ~0.1-10 ms, loads more.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoaderMetrics:
    """Counters, gauges and a histogram of one loader (thread-safe).

    Args:
        registry: where the Prometheus collectors register (default: a new registry).
        tenant: value of the ``tenant`` label on every series.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, tenant: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._counts: _Counts[str] = _Counts()
        self._misses: _Counts[str] = _Counts()
        self._shortened: _Counts[str] = _Counts()
        self._latency: dict[str, list[float]] = {}
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
        self._refused = Counter("kvwarm_loader_refused_cross_tenant",
                                "Refused attempts to reach another tenant's namespace.", t, registry=r)
        self._prefetch = Counter("kvwarm_loader_prefetch_blocks", "Blocks handled by prefetch, by outcome.",
                                 [*t, "outcome"], registry=r)
        self._pool_bytes = Gauge("kvwarm_pool_bytes_in_use", "Bytes of snapshots held in the node's shared pool.",
                                 registry=r)
        self._pool_budget = Gauge("kvwarm_pool_budget_bytes", "The node pool's byte budget.", registry=r)
        self._latency_h = Histogram("kvwarm_loader_load_seconds", "Latency of loader operations.", [*t, "stage"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        # Every series exists from the start, so dashboards see zeros, not gaps (and the
        # first request does not pay for creating them).
        for reason in MISS_REASONS:
            self._miss.labels(tenant, reason)
            self._short.labels(tenant, reason)
        for counter in (self._lookups, self._hits, self._tokens, self._mapped, self._refused):
            counter.labels(tenant)
        for stage in STAGES:
            self._latency_h.labels(tenant, stage)

    def _incr(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def lookup(self) -> None:
        self._incr("lookups")
        self._lookups.labels(self.tenant).inc()

    def hit(self, tokens: int) -> None:
        self._incr("hits")
        self._incr("tokens_served", tokens)
        self._hits.labels(self.tenant).inc()
        self._tokens.labels(self.tenant).inc(tokens)

    def miss(self, reason: str) -> None:
        """Count a lookup that returned no hit, under its reason."""
        if reason not in MISS_REASONS:
            raise ValueError(f"unknown miss reason {reason!r}; one of {', '.join(MISS_REASONS)}")
        with self._lock:
            self._misses[reason] += 1
        self._miss.labels(self.tenant, reason).inc()

    def shortened(self, reason: str) -> None:
        """Count a hit that stopped before a block the store holds (corrupt, expired, pool full...)."""
        if reason not in MISS_REASONS:
            raise ValueError(f"unknown reason {reason!r}; one of {', '.join(MISS_REASONS)}")
        with self._lock:
            self._shortened[reason] += 1
        self._short.labels(self.tenant, reason).inc()

    def mapped(self, nbytes: int) -> None:
        self._incr("bytes_mapped", nbytes)
        self._mapped.labels(self.tenant).inc(nbytes)

    def refused(self) -> None:
        self._incr("refused_cross_tenant")
        self._refused.labels(self.tenant).inc()

    def prefetched(self, outcome: str, n: int = 1) -> None:
        self._incr(f"prefetch_{outcome}", n)
        self._prefetch.labels(self.tenant, outcome).inc(n)

    def pool(self, in_use: int, budget: int) -> None:
        with self._lock:
            self._counts["pool_bytes_in_use"] = in_use
            self._counts["pool_budget_bytes"] = budget
        self._pool_bytes.set(in_use)
        self._pool_budget.set(budget)

    def observe(self, stage: str, seconds: float) -> None:
        """Record the latency of one ``lookup``, ``to_dynamic_cache`` or ``copy_into_paged``."""
        with self._lock:
            samples = self._latency.setdefault(stage, [])
            samples.append(seconds)
            if len(samples) > 4096:  # keep a bounded recent window for stats() percentiles
                del samples[:2048]
        self._latency_h.labels(self.tenant, stage).observe(seconds)

    def as_dict(self) -> dict[str, Any]:
        """Every figure as plain numbers: counters, misses by reason, latency percentiles."""
        with self._lock:
            out: dict[str, Any] = {k: (int(v) if float(v).is_integer() else v) for k, v in self._counts.items()}
            for name in ("lookups", "hits", "tokens_served", "bytes_mapped", "refused_cross_tenant"):
                out.setdefault(name, 0)
            out["misses"] = sum(self._misses.values())
            out["misses_by_reason"] = dict(self._misses)
            out["shortened_by_reason"] = dict(self._shortened)
            lat = {}
            for stage, samples in self._latency.items():
                s = sorted(samples)
                lat[stage] = {"count": len(s), "p50_s": s[len(s) // 2], "p99_s": s[min(len(s) - 1, int(len(s) * 0.99))]}
            out["latency"] = lat
        return out
