"""The node process's Prometheus collectors (``kvwarm_node_*``), on a registry of its own.

Counters are kept by the node as plain numbers (:class:`NodeCounters`, no lock on the request
path beyond the increment's) and read when Prometheus scrapes, with the copier's and the node
tier's figures.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: what the node counts, with its help text
COUNTERS = {
    "hellos": "Clients the node took (their version and store settings matched).",
    "hellos_refused": "Clients the node refused: another kvwarm version or another store configuration.",
    "lookups": "Lookups answered.",
    "lookup_blocks": "Blocks lookups asked for.",
    "lookup_hits": "Blocks lookups found in the node tier (leading blocks only).",
    "prefetch_hints": "Prefetch hints clients sent.",
    "records": "Requests recorded in fleet memory.",
    "gc_runs": "Garbage collections of the node tier.",
    "gc_removed": "Snapshots GC removed from the node tier (expired, evicted or crash leftovers).",
    "errors": "Requests the node answered with an error.",
    "rings_attached": "Write-back rings engines announced (loader.write_back_via = node).",
}

#: the node's gauges, with their help text
GAUGES = {
    "clients": "Clients connected now.",
    "tier_bytes": "Bytes the node tier holds (snapshots and writes in flight).",
    "copies_queued": "Chains waiting to be copied from the shared tier.",
}


class NodeCounters:
    """The node's counts (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def incr(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (one of :data:`COUNTERS`)."""
        if name not in COUNTERS:
            raise KeyError(f"unknown node counter {name!r}; one of {', '.join(COUNTERS)}")
        with self._lock:
            self._c[name] += n

    def add(self, **counts: int) -> None:
        """Add to several counters at once (one lock for a request's counts)."""
        bad = set(counts) - set(COUNTERS)
        if bad:
            raise KeyError(f"unknown node counters {sorted(bad)}; one of {', '.join(COUNTERS)}")
        with self._lock:
            self._c.update(counts)

    def snapshot(self) -> dict[str, int]:
        """Every counter's value now."""
        with self._lock:
            return {k: self._c.get(k, 0) for k in COUNTERS}


#: the write-back's counters (:meth:`store.node.writes.NodeWrites.stats`) a scrape shows, with their help
#: text; ``<name>:<reason>`` keys become one labelled counter per name
WRITE_BACK = {
    "written_back_blocks": "Blocks the node wrote to the node tier from the engines' rings.",
    "written_back_bytes": "Bytes of those blocks.",
    "written_back_uploads": "Blocks the node uploaded to the shared tiers.",
    "write_back_dropped": "Blocks not stored, by reason (engine_gone: an engine died mid-block; invalid; "
                          "no_credentials; error).",
    "upload_dropped": "Blocks stored on NVMe that left the upload backlog without reaching the shared tier, by "
                      "reason (evicted, expired, corrupt, error, no_space, unrecorded).",
    "upload_backlog_resumed": "Backlog rows a restarted node found waiting.",
    "ring_discarded": "Unfinished records the node discarded from rings whose engine died.",
}


class NodeCollector(Collector):
    """What a scrape reads: the counters, the copier's outcomes, the write-back's counts and drops by reason,
    the clients connected, the tier's bytes."""

    def __init__(self, counters: NodeCounters, copies: Callable[[], dict[str, int]],
                 gauges: Callable[[], dict[str, float]], info: dict[str, str],
                 write_back: Callable[[], dict[str, float]] = dict) -> None:
        self.counters = counters
        self.copies = copies
        self.gauges = gauges
        self.info = info
        self.write_back = write_back

    def collect(self) -> Iterator[Metric]:
        for name, value in self.counters.snapshot().items():
            c = CounterMetricFamily(f"kvwarm_node_{name}", COUNTERS[name])
            c.add_metric([], value)
            yield c
        copies = CounterMetricFamily("kvwarm_node_copies", "Copies from the shared tier into the node tier, by "
                                     "outcome (copied, present, absent, refused, ...).", labels=["outcome"])
        for outcome, n in sorted(self.copies().items()):
            copies.add_metric([outcome], n)
        yield copies
        yield from write_back_metrics(self.write_back())
        for name, value in self.gauges().items():
            g = GaugeMetricFamily(f"kvwarm_node_{name}", GAUGES.get(name, name))
            g.add_metric([], value)
            yield g
        info = GaugeMetricFamily("kvwarm_node_info", "The node's kvwarm version and store settings' fingerprint.",
                                 labels=sorted(self.info))
        info.add_metric([self.info[k] for k in sorted(self.info)], 1)
        yield info


def write_back_metrics(stats: dict[str, float]) -> Iterator[Metric]:
    """``kvwarm_node_<name>`` for each of :data:`WRITE_BACK`: plain, or by ``reason`` (every such counter is
    shown, at 0 with no reason yet, so that a dashboard's query finds it)."""
    for name, help_text in WRITE_BACK.items():
        reasons = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith(name + ":")}
        if name.endswith("_dropped"):
            c = CounterMetricFamily(f"kvwarm_node_{name}", help_text, labels=["reason"])
            for reason, value in sorted(reasons.items()):
                c.add_metric([reason], float(value))
        else:
            c = CounterMetricFamily(f"kvwarm_node_{name}", help_text)
            c.add_metric([], float(stats.get(name, 0)))
        yield c


def node_registry(collector: NodeCollector) -> CollectorRegistry:
    """A registry holding only the node's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
