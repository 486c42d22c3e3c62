"""The cross-tenant check, off the request path: does another tenant hold the prefix a request missed?

A request whose own chains hold nothing of its prompt may be asking for a prefix another tenant
of the engine holds. That is a refused cross-tenant access: counted (``refused_cross_tenant``,
the request's miss under ``tenant_refused``) and logged with the request id and the tenants'
names, never keys or prompts. The client must not be able to tell (docs/concepts/tenants.md):
what it receives, and when, may not depend on the answer. So the scheduler only queues the
check, the same constant work whoever holds the prefix, and this module's one thread runs it
after the answer, probing every other tenant (:meth:`StoreProbe.held_by_others`), and counts the
request's lookup with its miss then (one interval: ``lookups == hits + misses``).

The queue is bounded (:data:`CAPACITY`): a check that does not fit is dropped, the miss counted
at once under its own reason, and the drop as ``cross_tenant_unchecked``. Pure of vLLM.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from store.engines.vllm.probe import StoreProbe
from store.engines.vllm.stats import Counters

log = logging.getLogger("kvwarm.vllm")
#: Most checks waiting at once (each holds one block of token ids).
CAPACITY = 1024


@dataclass(frozen=True)
class Check:
    """One request's check: its id (for the log), tenant, first block, and the miss reason it was answered."""

    req_id: str
    tenant: str
    head: tuple[int, ...]
    reason: str


class CrossTenantAudit:
    """The checks of one scheduler role, on one background thread.

    Args:
        probe: the role's probe of the local tier (thread-safe).
        counters: the role's counters (each check counts its request's lookup and miss there).
        capacity: most checks waiting at once.
    """

    def __init__(self, probe: StoreProbe, counters: Counters, *, capacity: int = CAPACITY) -> None:
        self.probe = probe
        self.counters = counters
        self._queue: queue.Queue[Check | None] = queue.Queue(maxsize=capacity)
        self._idle = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None  # started by the first check

    def submit(self, check: Check) -> None:
        """Queue ``check`` (never blocks; a full queue counts the miss now, unchecked)."""
        with self._idle:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvwarm-tenant-audit", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(check)
        except queue.Full:
            self._done()
            self.counters.add_many(("lookups", None), ("misses", check.reason), ("cross_tenant_unchecked", None))

    def _run(self) -> None:
        while True:
            check = self._queue.get()
            if check is None:
                return
            try:
                holders = self.probe.held_by_others(check.tenant, check.head)
            except Exception:  # noqa: BLE001 - the check is best effort; the miss is counted all the same
                log.exception("kvwarm cross-tenant check of request %s failed", check.req_id)
                holders = []
            if holders:
                log.warning("request %s of tenant %r missed a prefix that tenant(s) %s hold: refused",
                            check.req_id, check.tenant, ", ".join(repr(h) for h in holders))
                self.counters.add_many(("lookups", None), ("misses", "tenant_refused"), ("refused_cross_tenant", None))
            else:
                self.counters.add_many(("lookups", None), ("misses", check.reason))
            self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued check to be counted; whether they all were."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Count what is queued, then stop the thread (waits up to ``timeout_s``)."""
        with self._idle:
            thread = self._thread
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return  # the daemon thread ends with the process
        thread.join(timeout_s)
