"""The connector's figures in vLLM's metrics: its ``KVConnectorStats`` and the ``kvwarm_connector_*`` series.

vLLM collects each role's :meth:`store.engines.vllm.stats.Counters.take` every step as a
:class:`KvwarmStats`, sums the workers' and the scheduler's (:meth:`KvwarmStats.aggregate`),
logs :meth:`KvwarmStats.reduce` ("KV Transfer metrics: ..."), and hands the dict to the API
server's :class:`KvwarmPromMetrics`, which adds it to the series on ``/metrics`` (labels
``model_name``, ``engine``, and ``reason`` where a counter has one). A kvwarm registry in the
worker process would not be on the server's ``/metrics``: everything goes through the stats dict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from store.engines.vllm.stats import LATENCIES, labelled, merge, reduce
from store.miss import MissReason
from store.serving.metrics import LATENCY_BUCKETS

#: the loader's miss reasons (label values), which the connector's reasons extend
MISS_REASONS = tuple(reason.value for reason in MissReason)
#: ``kvwarm_connector_<name>_total``: counters without a label.
COUNTERS = {
    "lookups": "Requests looked up in kvwarm, counted once each with their outcome: lookups = hits + misses.",
    "hits": "Requests the worker loaded stored KV into (counted when it reports the load, once per request).",
    "tokens_matched": "Prompt tokens answered to vLLM as stored and allocated for loading (a request's first "
                      "allocation: a reload after preemption is not counted again).",
    "refused_cross_tenant": "Requests whose prefix is stored for another tenant, refused (checked after the answer; "
                            "their miss counts as tenant_refused).",
    "cross_tenant_unchecked": "Misses whose cross-tenant check was dropped (its queue was full).",
    "loads": "Loads into the engine's blocks that wrote at least one block.",
    "tokens_loaded": "Prompt tokens loaded into the engine's blocks.",
    "bytes_loaded": "Stored bytes read by loads.",
    "written_back_blocks": "Blocks the engine computed, written to the store (write-back, not prefill).",
    "written_back_bytes": "Bytes of written-back snapshots.",
    "write_back_handed": "Blocks the engine handed to the node process through its write-back ring "
                         "(loader.write_back_via = node); the node writes and uploads them.",
    "written_back_uploads": "Written-back blocks the upload streams put in the remote tier (S3), drained from the "
                            "upload backlog (this process's or one an earlier process left).",
    "upload_present": "Upload backlog entries whose block the remote tier (S3) held already: nothing sent.",
    "upload_backlog_resumed": "Blocks found waiting in the node's upload backlog when a writer started (left by an "
                              "earlier process, or another's on the node); drained like any.",
    "upload_backlog_rescanned": "Blocks on NVMe enqueued again after the upload backlog's file was found damaged "
                                "(those S3 holds are then skipped, counted upload_present).",
    "prefetched_blocks": "Blocks the node agent's prefetches mapped into the node's pool.",
    "prefetch_copied_blocks": "Blocks the node agent's prefetches copied from S3 into NVMe in the engine's process "
                              "(while the node process was away).",
    "prefetch_handed_to_node": "Blocks the node agent's prefetches handed to the node process to copy from S3.",
    "prefetch_superseded": "Prefixes a prefetch never started because a newer plan replaced it.",
    "agent_rankings": "Rankings the node agents applied (at start, and for each new plan).",
    "agent_copies_queued": "Blocks the node agents queued for copying.",
    "agent_plan_errors": "Plans the node agents could not use (unreadable, too large or wrong types): each "
                         "version counted once, the agent keeping its last good plan.",
    "agent_plan_entries_skipped": "Published plan entries the node agents skipped: keyed under another key root "
                                  "(model, precision or tenant secret) than the loader's.",
}
#: ``kvwarm_connector_<name>_total{reason=...}``, and the reasons created at start.
LABELLED = {
    "misses": ("Requests that load nothing, by reason.",
               (*MISS_REASONS, "engine_cached", "slower_than_prefill", "tenant_unknown", "tenant_unverified",
                "unsupported", "skip_reading_prefix_cache", "aborted", "loads_off")),
    "shortened": ("Requests that load less than the store could give, by reason.", MISS_REASONS),
    "load_failures": ("Loads that wrote fewer blocks than planned (vLLM recomputes the rest), by reason.",
                      MISS_REASONS),
    "write_back_skipped": ("Blocks not written back, by reason (present: the store had them).", ("present",)),
    "write_back_dropped": ("Blocks dropped by write-back, by reason (queue_full: kvwarm blocks at the tail of a "
                           "save the copy queue could not take; ring_full: the tail of a save the node's ring "
                           "had no room for; error: a block not written to NVMe).",
                           ("queue_full", "ring_full", "error")),
    "upload_dropped": ("Written-back blocks that left the upload backlog without reaching the remote tier (S3), by "
                       "reason (evicted: gone from NVMe before their turn; expired; corrupt: the NVMe copy failed its "
                       "checks and was quarantined; error: refused at every attempt; no_space, unrecorded: the "
                       "backlog could not record them, the disk full or its database unusable).",
                       ("evicted", "expired", "corrupt", "error", "no_space", "unrecorded")),
}
PREFIX = "kvwarm_connector_"


@dataclass
class KvwarmStats(KVConnectorStats):
    """One interval's figures (``data``: the dict :mod:`store.engines.vllm.stats` describes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvwarmPromMetrics(KVConnectorPromMetrics):
    """The ``kvwarm_connector_*`` series, made once in the API server, fed each interval."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._plain: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
            self._plain[name] = {i: counter.labels(*v) for i, v in per_engine_labelvalues.items()}
        self._labelled: dict[str, Any] = {}
        for name, (doc, reasons) in LABELLED.items():
            counter = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=[*labelnames, "reason"])
            self._labelled[name] = counter
            for values in per_engine_labelvalues.values():
                for reason in reasons:
                    counter.labels(*values, reason)
        hist = self._histogram_cls(name=PREFIX + "load_seconds", documentation="Seconds per load into the engine's "
                                   "blocks (mapping to the last write).", labelnames=labelnames,
                                   buckets=LATENCY_BUCKETS)
        self._latency = {i: hist.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for name, by_engine in self._plain.items():
            n = transfer_stats_data.get(name)
            if n:
                by_engine[engine_idx].inc(n)
        for name, counter in self._labelled.items():
            for reason, n in labelled(transfer_stats_data, name).items():
                if n:
                    counter.labels(*values, reason).inc(n)
        for seconds in transfer_stats_data.get(LATENCIES, ()):
            self._latency[engine_idx].observe(seconds)

