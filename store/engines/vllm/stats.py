"""The connector's figures: counters each role keeps, sent to vLLM's metrics each step.

Each role counts into a :class:`Counters`; vLLM collects ``take()`` every step (the worker's and
the scheduler's, summed by :func:`merge`) and carries the dict to the API server, where
:mod:`store.engines.vllm.prom` turns it into ``kvwarm_connector_*`` series on ``/metrics``. The
keys, with ``name:label`` for a counter with a ``reason`` label:

scheduler role:
    ``lookups``, ``hits``, ``misses:<reason>``: each request's lookup is counted once, at the same
    moment as its outcome, so ``lookups == hits + misses`` (a request still waiting for its
    answer, its load or its cross-tenant check is in none of them). ``hits``: requests the worker
    reported tokens loaded into (``update_output``, ``LoadResult.loaded``), not answers;
    ``misses``: answered 0, vLLM took none of the answer (``engine_cached``), the request skips
    prefix caches (``skip_reading_prefix_cache``: vLLM overrides any answer with 0), its load wrote
    nothing (the worker's reason), or it ended before its answer was allocated (``aborted``).
    ``tokens_matched`` (tokens answered to vLLM and allocated, at a request's first allocation:
    a reload after preemption is not counted again), ``shortened:<reason>`` (with a hit),
    ``refused_cross_tenant`` (with a ``tenant_refused`` miss, :mod:`store.engines.vllm.audit`),
    ``cross_tenant_unchecked`` (a check dropped, its queue full).
worker role:
    ``loads``, ``tokens_loaded``, ``bytes_loaded``, ``load_seconds`` (their sum) and
    ``load_latencies`` (each load's seconds: a histogram), ``load_failures:<reason>``,
    ``written_back_blocks``, ``written_back_bytes``, ``write_back_skipped:<reason>`` (``present``:
    the store had it), ``write_back_dropped:<reason>`` (``queue_full``, ``ring_full``, ``error``),
    ``write_back_handed`` (blocks given to the node through the write-back ring), the upload
    backlog's ``written_back_uploads``, ``upload_present``, ``upload_backlog_resumed``,
    ``upload_backlog_rescanned`` and ``upload_dropped:<reason>`` (``evicted``, ``expired``,
    ``corrupt``, ``error``, ``no_space``, ``unrecorded``: :mod:`store.engines.vllm.uploads`),
    ``prefetched_blocks``, ``prefetch_copied_blocks`` (copied from S3 in the engine's process) and
    ``prefetch_handed_to_node`` (handed to the node process to copy).

Miss reasons: the loader's (``absent``, ``short_prompt``, ``fetch_scheduled``, ``fetch_timeout``,
``store_unavailable``, ``corrupt``, ``mismatch``, ``expired``, ``tenant_refused``, ...) and the
connector's own: ``engine_cached`` (vLLM's own prefix cache already has the stored tokens),
``slower_than_prefill`` (the cost estimate), ``tenant_unknown`` (a cache_salt or tenant name the
config does not know), ``tenant_unverified`` (a tenant name without its cache_salt, while
``tenants.trust_named`` is off), ``unsupported`` (multimodal inputs, a LoRA adapter or prompt
embeddings: KV that depends on more than the tokens), ``skip_reading_prefix_cache``, ``aborted``,
``loads_off`` (``load_mode: off``: the engine only writes back).
The tenancy reasons are the server's: a client is told ``absent``. Pure: no vLLM.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Mapping

#: Most latency samples one interval keeps (the rest of the interval still counts in the sums).
MAX_SAMPLES = 1024
LATENCIES = "load_latencies"


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``other``'s figures to ``into`` (numbers summed, latency samples joined, bounded)."""
    for key, value in other.items():
        if key == LATENCIES:
            into[key] = (list(into.get(key, [])) + list(value))[-MAX_SAMPLES:]
        else:
            into[key] = into.get(key, 0) + value
    return into


def reduce(data: Mapping[str, Any]) -> dict[str, int | float]:
    """One interval's figures as plain numbers (the median load latency instead of the samples)."""
    out: dict[str, int | float] = {k: v for k, v in data.items() if k != LATENCIES}
    samples = sorted(data.get(LATENCIES, []))
    if samples:
        out["load_seconds_p50"] = samples[len(samples) // 2]
    return out


def labelled(data: Mapping[str, Any], name: str) -> dict[str, float]:
    """The ``reason`` values of counter ``name`` (``misses`` -> ``{"absent": 3, ...}``)."""
    prefix = name + ":"
    return {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)}


class Counters:
    """One role's counters since the last :meth:`take`, and since start (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: Counter[str] = Counter()
        self._samples: list[float] = []
        self._total: Counter[str] = Counter()

    def add(self, name: str, n: float = 1, reason: str | None = None) -> None:
        """Count ``n`` under ``name`` (with its ``reason``, for the labelled counters)."""
        key = f"{name}:{reason}" if reason is not None else name
        with self._lock:
            self._interval[key] += n
            self._total[key] += n

    def add_many(self, *counts: tuple[str, str | None]) -> None:
        """Count 1 under each ``(name, reason)`` at once: the figures can never land in different
        intervals (a request's lookup and its outcome, so that ``lookups == hits + misses``)."""
        with self._lock:
            for name, reason in counts:
                key = f"{name}:{reason}" if reason is not None else name
                self._interval[key] += 1
                self._total[key] += 1

    def sample(self, seconds: float) -> None:
        """Record one load's latency."""
        with self._lock:
            if len(self._samples) < MAX_SAMPLES:
                self._samples.append(seconds)

    def take(self) -> dict[str, Any]:
        """The interval's figures, and a fresh interval (vLLM sends each interval once)."""
        with self._lock:
            out: dict[str, Any] = dict(self._interval)
            if self._samples:
                out[LATENCIES] = self._samples
            self._interval, self._samples = Counter(), []
        return out

    def totals(self) -> dict[str, float]:
        """Everything counted since start."""
        with self._lock:
            return dict(self._total)
