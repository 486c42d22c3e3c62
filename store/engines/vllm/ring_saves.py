"""Write-back through the node: the engine's end of its write-back ring (``loader.write_back_via = node``).

The worker creates a ring of its own (:class:`store.node.ring.Ring`, under ``/dev/shm``, of
``loader.write_back_ring_bytes``) and announces it to the machine's node (the ``ATTACH`` op, on a
:class:`store.node.client.NodeClient` of the worker's own), which attaches the reader and stores
what comes (:mod:`store.node.writer`: NVMe, then the upload backlog, whose upload threads run in the
node). For each block of a save, the write-back thread (:class:`store.engines.vllm.writeback.WriteBack`,
after the copies off the device are done) only reserves a slot (never waits: no room, the rest of
the save is dropped and counted ``write_back_dropped:ring_full``), copies each stored tensor in
(one ``memcpy`` each) and commits (:func:`store.node.block_record.write_block`).

When no node takes the ring (none answers, it refused this engine, it was killed: its consumer
lock is free) or the node holds no credentials for a save's tenant, :meth:`RingSaves.hand` says so
and the save is written in the engine, as with ``loader.write_back_via = engine``: the engine's upload
threads start then (:class:`LazyUploads`), and until then the node makes every S3 write. A node that
comes back is announced the ring again; it delivers what the dead one had not released (written
once: a block already on NVMe is skipped). The serving path never fails because of the node.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import SaveSpec
from store.engines.vllm.stats import Counters
from store.engines.vllm.tenancy import TenantBook
from store.engines.vllm.uploads import Uploads
from store.errors import KvwarmError, NodeUnavailable
from store.format.encode import EncodedSnapshot
from store.format.precision import Precision
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.identity.tenant import Tenant
from store.kernels.gather import StoredBlocks
from store.node.block_record import Announcement, block_meta, write_block
from store.node.client import NodeClient
from store.node.ring import Ring
from store.node.ring_writer import RING_FULL
from store.node.spawn import wait_starting

log = logging.getLogger("kvwarm.vllm")
#: where rings are made (the node maps them from there)
RING_DIR = "/dev/shm"
#: while no node takes the ring, how often a save tries to connect and announce it (the others are
#: written in the engine)
RETRY_S = 1.0
#: the first save waits this long for a node that is on its way (the scheduler role starting one): an
#: engine's first blocks then go to the node like the rest, not into the engine's own files
START_WAIT_S = 30.0


class Handoff(Protocol):
    """Where :class:`store.engines.vllm.writeback.WriteBack` hands saves instead of writing them."""

    def hand(self, spec: SaveSpec, layers: list[StoredBlocks], errors: list[list[list[float]]], row: int) -> bool: ...

    def drain(self, deadline: float) -> bool: ...

    def close(self) -> None: ...


class LazyUploads:
    """The engine's upload threads, started only when the engine writes a block itself (no node took
    it): while the node takes every block, the node makes every S3 write; once the engine writes,
    it uploads as with ``loader.write_back_via = engine`` (its blocks, and what waits in the backlog).

    Args:
        make: makes the :class:`store.engines.vllm.uploads.Uploads` (its threads start with it).
    """

    def __init__(self, make: Callable[[], Uploads]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._rankings: dict[str, Mapping[str, float]] = {}
        self.started: Uploads | None = None

    def put(self, tenant: Tenant, snap: EncodedSnapshot) -> bool:
        """:meth:`Uploads.put`, starting the threads first."""
        with self._lock:
            if self.started is None:
                self.started = self._make()
                for source, ranks in self._rankings.items():
                    self.started.set_ranking(source, ranks)
            up = self.started
        return up.put(tenant, snap)

    def set_ranking(self, source: str, ranks: Mapping[str, float]) -> int:
        """:meth:`Uploads.set_ranking` (kept for the threads until they start)."""
        with self._lock:
            up = self.started
            if up is None:
                self._rankings[source] = dict(ranks)
                return 0
        return up.set_ranking(source, ranks)

    def drain(self, deadline: float) -> bool:
        return self.started is None or self.started.drain(deadline)

    def stop(self) -> None:
        if self.started is not None:
            self.started.stop()

    def close(self) -> None:
        if self.started is not None:
            self.started.close()


class RingSaves:
    """One worker's write-back ring and its announcement to the node.

    Args:
        client: a client of the machine's node (not started: this starts its background connection).
        tenants: the tenants' credentials (a block's key is keyed with its tenant's salt).
        identities, precision, kv_block, ttl_s, layout, layers: what the blocks are (announced once).
        counters: ``write_back_handed`` (blocks given to the node), ``write_back_dropped:ring_full``.
        ring_bytes: the ring's size.
        ring_dir: where the ring's file is made.
        clock: wall time (the blocks' creation times).

    Raises:
        OSError: the ring cannot be made (``/dev/shm`` full): write-back stays in the engine.
    """

    def __init__(self, client: NodeClient, tenants: TenantBook, identities: tuple[ModelIdentity, ModelIdentity | None],
                 precision: Precision, *, kv_block: int, ttl_s: float, layout: EngineLayout, layers: int,
                 counters: Counters, ring_bytes: int, ring_dir: str | os.PathLike[str] = RING_DIR,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.clock = clock
        self.tenants = tenants
        self.identities = identities
        self.precision = precision
        self.kv_block = kv_block
        self.counters = counters
        path = Path(ring_dir) / f"kvwarm-wb-{os.getpid()}-{uuid.uuid4().hex[:8]}.ring"
        self.ring = Ring.create(path, ring_bytes)
        self.writer = self.ring.writer()
        self.announcement = Announcement(ring=str(path), identities=identities, precision=precision, kv_block=kv_block,
                                         ttl_s=ttl_s, kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                                         layers=layers, pid=os.getpid(), tenants=tuple(sorted(tenants.known)))
        self.sizes = self.announcement.part_nbytes()
        self._refused: frozenset[str] | None = None  # set while the node drains this ring
        self.announced = 0
        self._next_try = 0.0
        self._waited = False
        client.reconnect_in_background()

    def attached(self) -> bool:
        """Whether a node drains this ring now (announcing it when a node answers and none does)."""
        if self._refused is not None and self.ring.consumer_alive():
            return True
        self._refused = None
        now = time.monotonic()
        if now < self._next_try:
            return False
        if not self._waited:  # the first save: a node being started now is waited for (on the writer's thread)
            self._waited = True
            wait_starting(self.client.path, START_WAIT_S)
        self._next_try = now + RETRY_S  # on this (the writer's) thread: no wait for the client's back-off
        reply = None
        for _ in range(2):  # a connection to a node that has died is found out by the first try
            try:
                if not self.client.connected:
                    self.client.connect()
                reply = self.client.attach(self.announcement)
                break
            except NodeUnavailable as exc:
                log.debug("kvwarm write-back: the node does not take the ring now (%s)", exc)
            except KvwarmError as exc:  # refused: written here meanwhile
                log.debug("kvwarm write-back: the node does not take the ring (%s)", exc)
                return False
        if reply is None:
            return False
        self._refused = frozenset(reply.get("refused", ()))
        self.announced += 1
        log.info("kvwarm write-back: the node (pid %s) drains ring %s", self.client.node.get("pid"), self.ring.path)
        return self.ring.consumer_alive()

    def hand(self, spec: SaveSpec, layers: list[StoredBlocks], errors: list[list[list[float]]], row: int) -> bool:
        """Hand one save's blocks (rows ``row ..`` of ``layers``) to the node; ``False`` when the node
        does not take it now (the caller writes it). Blocks that find the ring full are dropped, counted."""
        if not self.attached() or spec.tenant in (self._refused or ()):
            return False
        tenant = self.tenants.credentials(spec.tenant)
        identity = self.identities[1] if spec.chat else self.identities[0]
        if identity is None:
            raise ValueError("a chat-keyed save for a model without a chat template")
        root = identity.key_root(self.precision, self.kv_block, tenant.salt)
        blocks = block_chain(root, spec.token_ids)[spec.first:]
        for n, (j, block) in enumerate(enumerate(blocks, start=row)):
            meta = block_meta(spec.tenant, block, chain=int(spec.chat), precision=self.precision, now=self.clock(),
                              layers=len(layers))
            if not write_block(self.writer, self.sizes, meta, block.tokens, [layer.block(j) for layer in layers],
                               [e[0][j] for e in errors], [e[1][j] for e in errors]):
                # the rest of the save too: a block is found only after its parents
                self.counters.add("write_back_dropped", len(blocks) - n, reason=RING_FULL)
                return True
            self.counters.add("write_back_handed")
        return True

    def drain(self, deadline: float) -> bool:
        """Wait until the node has stored every record handed to it (while it is alive; monotonic
        ``deadline``); whether it has."""
        while self.writer.pending and self.ring.consumer_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.writer.pending == 0

    def close(self) -> None:
        """Let go of the ring: the node stores what is left and removes it (no node: removed now)."""
        drained = not self.ring.consumer_alive()
        self.ring.close()
        if drained:
            self.ring.unlink()
        self.client.close()


def ring_saves(client: NodeClient | None, *, layers: int, ring_bytes: int, **kw: object) -> RingSaves | None:
    """A :class:`RingSaves`, or ``None`` (written in the engine, reason logged) when there is no client
    or the ring cannot be made."""
    if client is None:
        return None
    try:
        return RingSaves(client, layers=layers, ring_bytes=ring_bytes, **kw)  # type: ignore[arg-type]
    except (OSError, KvwarmError, ValueError) as exc:
        log.warning("kvwarm write-back: no ring to the node (%s); blocks are written in the engine", exc)
        client.close()
        return None

