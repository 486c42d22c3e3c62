"""Write-back: the full prompt blocks the engine computed go to the store as ordinary snapshots.

After a step's forward, the worker copies the blocks a :class:`store.engines.vllm.metadata.SaveSpec`
names out of the engine's cache (one indexed copy per layer: the engine may reuse them once the
step is over; from a GPU into pinned host memory, with an event the writer waits for) and hands
them to :class:`WriteBack`. One background thread does the rest, off the
forward path: it reorders them into kvwarm's layout, skips blocks the store already holds,
quantises at the configured precision (recording the error), and writes each block atomically
through :meth:`store.tiers.store.Store.put` (every tier; with the config's TTL and the tenant's
salt). So a restarted or new replica is warm from the store even for prefixes no plan named.

Bounded: at most ``max_bytes`` of copied blocks wait; a save that does not fit is dropped and
counted (``write_back_dropped:queue_full``), never waited for. After S3 fails, blocks are written
to NVMe only for ``s3_backoff_s``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import SaveSpec
from store.engines.vllm.paging import take_blocks, unpack_blocks
from store.engines.vllm.stats import Counters
from store.engines.vllm.tenancy import TenantBook
from store.errors import StoreError, StoreUnavailable
from store.format.encode import build_snapshot
from store.format.header import WRITE_BACK
from store.format.precision import Precision
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.tiers.base import object_name
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")
#: Default bound on copied blocks waiting to be written.
MAX_QUEUED_BYTES = 256 << 20


@dataclass(frozen=True)
class _Job:
    spec: SaveSpec
    layers: list[torch.Tensor]  # per layer, the engine blocks as take_blocks copied them (host memory)
    nbytes: int
    ready: Any = None  # a CUDA event after the copies into ``layers``; None: they are done


class WriteBack:
    """The background writer of one worker.

    Args:
        store: every tier, NVMe first.
        tenants: whose namespace and salt each block goes under.
        identities: the model's identities, plain and chat-keyed (a save extends the chain its spec names).
        precision: the storage precision.
        kv_block: kvwarm's block size.
        ttl_s: the snapshots' lifetime.
        layout: the engine's KV layout.
        counters: where ``written_back_*`` and ``write_back_*`` are counted.
        max_bytes: the most copied bytes that wait.
        s3_backoff_s: after S3 fails, NVMe only for this long.
        clock: wall time (snapshot creation times).
    """

    def __init__(self, store: Store, tenants: TenantBook, identities: tuple[ModelIdentity, ModelIdentity | None],
                 precision: Precision, *,
                 kv_block: int, ttl_s: float, layout: EngineLayout, counters: Counters,
                 max_bytes: int = MAX_QUEUED_BYTES, s3_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        local = store.local
        assert local is not None, "the store's first tier must be local"
        self.local = local
        self._local_only = Store([local])
        self.tenants = tenants
        self.identities = identities
        self.precision = precision
        self.kv_block = kv_block
        self.ttl_s = ttl_s
        self.layout = layout
        self.counters = counters
        self.max_bytes = max_bytes
        self.s3_backoff_s = s3_backoff_s
        self.clock = clock
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0
        self._s3_after = 0.0
        self._thread = threading.Thread(target=self._run, name="kvwarm-writeback", daemon=True)
        self._thread.start()

    def room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more copied blocks may wait now."""
        with self._lock:
            return self._queued + nbytes <= self.max_bytes

    def copy_out(self, spec: SaveSpec, caches: Sequence[torch.Tensor]) -> bool:
        """Copy the save's engine blocks out of every layer's cache (into host memory) and queue them;
        ``False`` (counted ``queue_full``) when they do not fit. Call after the step's forward.

        From a GPU the copies run on the current (the forward's) stream, after it; the writer waits
        for an event recorded after them.
        """
        nbytes = len(caches) * len(spec.block_ids) * self.layout.block_bytes
        if not self.room(nbytes):
            self.counters.add("write_back_dropped", len(spec.block_ids) * self.layout.block_size // self.kv_block,
                              reason="queue_full")
            return False
        layers = [take_blocks(c, self.layout, spec.block_ids, host=True) for c in caches]
        ready = None
        if caches and caches[0].device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(caches[0].device))
        return self.submit(spec, layers, ready=ready)

    def submit(self, spec: SaveSpec, layers: Sequence[torch.Tensor], ready: Any = None) -> bool:
        """Queue copied blocks for writing; ``False`` (counted) when the queue is full.

        ``ready``: an event (``synchronize()``) the copies into ``layers`` end with, waited for here,
        on the writer's thread, before it reads them.
        """
        nbytes = sum(t.numel() * t.element_size() for t in layers)
        with self._lock:
            if self._queued + nbytes > self.max_bytes:
                self.counters.add("write_back_dropped", len(spec.block_ids) * self.layout.block_size // self.kv_block,
                                  reason="queue_full")
                return False
            self._queued += nbytes
        self._queue.put(_Job(spec, list(layers), nbytes, ready))
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception:  # noqa: BLE001 - the writer thread must outlive any one bad save
                log.exception("kvwarm write-back of request %s failed", job.spec.req_id)
                self.counters.add("write_back_dropped", reason="error")
            finally:
                with self._lock:
                    self._queued -= job.nbytes
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()  # the device-to-host copies of this job, not a stream
        spec = job.spec
        tenant = self.tenants.credentials(spec.tenant)
        identity = self.identities[1] if spec.chat else self.identities[0]
        if identity is None:
            raise ValueError("a chat-keyed save for a model without a chat template")
        root = identity.key_root(self.precision, self.kv_block, tenant.salt)
        blocks = block_chain(root, spec.token_ids)[spec.first:]
        kv = [unpack_blocks(t, self.layout) for t in job.layers]  # per layer, [heads, n * kv_block, dim]
        store = self.store if time.monotonic() >= self._s3_after else self._local_only
        for j, block in enumerate(blocks):
            if self.local.exists(object_name(spec.tenant, block.key)):
                self.counters.add("write_back_skipped", reason="present")
                continue
            part = slice(j * self.kv_block, (j + 1) * self.kv_block)
            snap = build_snapshot(root=root, block=block, tenant=spec.tenant,
                                  kv=[(k[:, part], v[:, part]) for k, v in kv], precision=self.precision,
                                  created_at=self.clock(), ttl_s=self.ttl_s, source=WRITE_BACK)
            try:
                try:
                    wrote = store.put(tenant, snap)
                except StoreUnavailable as exc:  # the remote tier rests a while; NVMe now
                    log.warning("kvwarm write-back: the remote tier failed (%s); NVMe only for %g s", exc,
                                self.s3_backoff_s)
                    self._s3_after = time.monotonic() + self.s3_backoff_s
                    store = self._local_only
                    wrote = store.put(tenant, snap) or self.local.exists(object_name(spec.tenant, block.key))
            except StoreError as exc:  # full, refused: this block is not written
                log.warning("kvwarm write-back of a block of request %s failed: %s", spec.req_id, exc)
                self.counters.add("write_back_dropped", reason="error")
                continue
            if wrote:
                self.counters.add("written_back_blocks")
                self.counters.add("written_back_bytes", snap.file_size)
            else:
                self.counters.add("write_back_skipped", reason="present")

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save is written (or ``timeout_s`` passed); whether it emptied."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued == 0 and self._queue.unfinished_tasks == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to ``timeout_s``), then stop the thread and release the store."""
        self.drain(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        self.store.close()
