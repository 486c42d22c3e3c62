"""Write-back: the full prompt blocks the engine computed go to the store as ordinary snapshots.

After a step's forward, the worker copies the blocks a :class:`store.engines.vllm.metadata.SaveSpec`
names out of the engine's cache (one indexed copy per layer: the engine may reuse them once the
step is over; from a GPU into pinned host memory, with an event the writer waits for) and hands
them to :class:`WriteBack`. Its background thread does the rest, off the forward path: it
reorders them into kvwarm's layout, skips blocks the store already holds, quantises at the
configured precision (recording the error), and writes each block atomically to NVMe
(:meth:`store.tiers.store.Store.put`, with the config's TTL and the tenant's salt), then enqueues
it in the node's persistent upload backlog (:class:`store.engines.vllm.uploads.Uploads`), whose
``streams`` threads drain it to the remote tiers (S3), most valuable first. So a restarted or new
replica is warm from the store even for prefixes no plan named.

Bounded: at most ``max_bytes`` of copied blocks wait to be encoded; a save that does not fit
keeps its leading kvwarm blocks that do (a block is found only after its parents) and the
tail is dropped and counted (``write_back_dropped:queue_full``, in kvwarm blocks), never
waited for. A job's copied bytes are freed once its blocks are encoded; the snapshots read
back for their upload are bounded apart by ``max_bytes`` too, and a block waits in the upload
backlog until the link takes it: a slow S3 never holds up the node's own tier. After S3
fails, nothing is sent to it for ``s3_backoff_s``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import SaveSpec
from store.engines.vllm.paging import take_blocks, unpack_blocks
from store.engines.vllm.stats import Counters
from store.engines.vllm.tenancy import TenantBook
from store.engines.vllm.uploads import Uploads
from store.errors import StoreError
from store.format.encode import build_snapshot
from store.format.header import WRITE_BACK
from store.format.precision import Precision
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.serving.priority import lower_this_thread
from store.tiers.base import object_name
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")
#: Default bound on copied blocks waiting to be encoded (and, apart, on uploads in flight).
MAX_QUEUED_BYTES = 2 << 30
#: Default upload threads (``loader.write_back_streams``).
UPLOAD_STREAMS = 4


@dataclass(frozen=True)
class _Job:
    spec: SaveSpec
    layers: list[torch.Tensor]  # per layer, the engine blocks as take_blocks copied them (host memory)
    nbytes: int
    ready: Any = None  # a CUDA event after the copies into ``layers``; None: they are done


class WriteBack:
    """The background writer of one worker.

    Args:
        store: every tier, NVMe first (the others are the remote tiers the uploads go to).
        tenants: whose namespace and salt each block goes under.
        identities: the model's identities, plain and chat-keyed (a save extends the chain its spec names).
        precision: the storage precision.
        kv_block: kvwarm's block size.
        ttl_s: the snapshots' lifetime.
        layout: the engine's KV layout.
        counters: where ``written_back_*`` and ``write_back_*`` are counted.
        max_bytes: the most copied bytes that wait to be encoded, and apart the most bytes
            read back for uploads in flight.
        streams: upload threads to the remote tiers.
        s3_backoff_s: after S3 fails, nothing is sent to it for this long.
        clock: wall time (snapshot creation times).
    """

    def __init__(self, store: Store, tenants: TenantBook, identities: tuple[ModelIdentity, ModelIdentity | None],
                 precision: Precision, *,
                 kv_block: int, ttl_s: float, layout: EngineLayout, counters: Counters,
                 max_bytes: int = MAX_QUEUED_BYTES, streams: int = UPLOAD_STREAMS, s3_backoff_s: float = 30.0,
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
        self.clock = clock
        self.uploads = (Uploads(Store(store.tiers[1:]), local, streams=streams, max_bytes=max_bytes,
                                backoff_s=s3_backoff_s, counters=counters, credentials=tenants.credentials,
                                tenants=tenants.known, clock=clock) if len(store.tiers) > 1 else None)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0
        self._peak = 0
        self._thread = threading.Thread(target=self._run, name="kvwarm-writeback", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        """Copied bytes waiting to be encoded now."""
        with self._lock:
            return self._queued

    @property
    def peak_bytes(self) -> int:
        """The most copied bytes that have waited at once."""
        with self._lock:
            return self._peak

    def copy_out(self, spec: SaveSpec, caches: Sequence[torch.Tensor]) -> int | None:
        """Copy the save's engine blocks out of every layer's cache (into host memory) and queue them,
        as many leading kvwarm blocks as fit. Call after the step's forward.

        Returns ``None`` when the whole save is queued, else the first kvwarm block not queued
        (it and the rest are counted ``write_back_dropped:queue_full``): what the scheduler may
        plan again. From a GPU the copies run on the current (the forward's) stream, after it;
        the writer waits for an event recorded after them.
        """
        ratio = self.kv_block // self.layout.block_size
        blocks = len(spec.block_ids) // ratio
        each = len(caches) * ratio * self.layout.block_bytes  # copied bytes of one kvwarm block
        with self._lock:
            fit = blocks if each == 0 else max(0, min(blocks, (self.max_bytes - self._queued) // each))
            nbytes = fit * each
            self._queued += nbytes
            self._peak = max(self._peak, self._queued)
        if fit < blocks:
            self.counters.add("write_back_dropped", blocks - fit, reason="queue_full")
        if fit == 0:
            return spec.first
        part = spec if fit == blocks else replace(spec, token_ids=spec.token_ids[: (spec.first + fit) * self.kv_block],
                                                  block_ids=spec.block_ids[: fit * ratio])
        try:
            layers = [take_blocks(c, self.layout, part.block_ids, host=True) for c in caches]
            ready = None
            if caches and caches[0].device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(caches[0].device))
        except BaseException:
            with self._lock:
                self._queued -= nbytes
            raise
        self._queue.put(_Job(part, layers, nbytes, ready))
        return None if fit == blocks else spec.first + fit

    def _run(self) -> None:
        lower_this_thread()  # the encoding yields the cores to the forward
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
                job = None  # the copies go now, not when the next save comes
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
        for j, block in enumerate(blocks):
            if self.local.exists(object_name(spec.tenant, block.key)):
                self.counters.add("write_back_skipped", reason="present")
                continue
            part = slice(j * self.kv_block, (j + 1) * self.kv_block)
            snap = build_snapshot(root=root, block=block, tenant=spec.tenant,
                                  kv=[(k[:, part], v[:, part]) for k, v in kv], precision=self.precision,
                                  created_at=self.clock(), ttl_s=self.ttl_s, source=WRITE_BACK)
            try:
                wrote = self._local_only.put(tenant, snap)
            except StoreError as exc:  # full, refused: this block is not written
                log.warning("kvwarm write-back of a block of request %s failed: %s", spec.req_id, exc)
                self.counters.add("write_back_dropped", reason="error")
                continue
            if not wrote:
                self.counters.add("write_back_skipped", reason="present")
                continue
            self.counters.add("written_back_blocks")
            self.counters.add("written_back_bytes", snap.file_size)
            if self.uploads is not None:
                self.uploads.put(tenant, snap)  # waits in the upload backlog until the link takes it

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save is written and uploaded (or ``timeout_s`` passed); whether it emptied."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                copied = self._queued == 0 and self._queue.unfinished_tasks == 0
            if copied:
                return self.uploads is None or self.uploads.drain(deadline)
            time.sleep(0.01)
        return False

    def close(self, timeout_s: float = 30.0) -> None:
        """Write and upload what is queued (up to ``timeout_s``; what is left then waits in the upload
        backlog for the next writer), then stop every thread and release the store."""
        self.drain(timeout_s)
        self._queue.put(None)
        if self.uploads is not None:
            self.uploads.stop()  # what the writer still writes waits in the backlog
        self._thread.join(timeout=5.0)
        if self.uploads is not None:
            self.uploads.close()
        self.store.close()
