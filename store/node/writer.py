"""The node's write-back: it reads each engine's ring and stores the blocks, then uploads them.

An engine announces its ring (:class:`store.node.block_record.Announcement`, the ``ATTACH`` op);
the node attaches the ring's reader and drains it on a thread of its own (:class:`RingDrain`):
each record is checked (its precision is the announced one, its key is its parent's and tokens'
chain key, the node holds its tenant's credentials), laid out as a snapshot and written atomically
to NVMe by :class:`store.serving.snapshot_writer.SnapshotWriter` (the same code as the engine's own
writer), then enqueued in the upload backlog, which the node's upload threads
(:class:`store.engines.vllm.uploads.Uploads`) drain to S3: the node owns every S3 write. A record is
released only after that, so a node killed before it is read again by the next node; a block the
tier holds already is skipped, so that is harmless. A record that fails its checks is dropped and
counted (``write_back_dropped:<reason>``). When the engine is gone (its ring's producer lock free)
and every record it committed is stored, the node unlinks the ring; slots it left unfinished are
discarded on the way (the ring's generations).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from store.engines.vllm.stats import Counters
from store.identity.keys import Block, KeyRoot, chain_key
from store.identity.tenant import Tenant
from store.node.block_record import Announcement, precision_id, read_block
from store.node.ring import Ring
from store.node.ring_reader import RingReader
from store.node.ring_record import Record
from store.serving.priority import lower_this_thread
from store.serving.snapshot_writer import SnapshotWriter
from store.tiers.base import Tier

log = logging.getLogger("kvwarm.node")
#: records stored between two looks at the stop flag
BATCH = 64


class RingDrain:
    """One engine's ring, drained into the node tier on a thread of its own.

    Args:
        ann: the engine's announcement (its ring, model, precision and shapes).
        local: the node tier.
        credentials: a namespace's credentials (``None``: the node lacks its secret).
        counters: the node's write-back counters.
        uploads: the node's upload backlog writer (``None``: no remote tier).

    Raises:
        FileNotFoundError, RingFormatMismatch, RingBusy: the ring cannot be read (the reply says so).
    """

    def __init__(self, ann: Announcement, local: Tier, credentials: Callable[[str], Tenant | None], counters: Counters,
                 uploads: object | None) -> None:
        self.ann = ann
        self.credentials = credentials
        self.counters = counters
        self._pid = precision_id(ann.precision)
        self._sizes = ann.part_nbytes()
        self._roots: dict[tuple[str, int], KeyRoot] = {}
        self.ring = Ring.attach(ann.ring)
        try:
            self.reader: RingReader = self.ring.reader()
        except BaseException:
            self.ring.close()
            raise
        self.blocks = SnapshotWriter(local, precision=ann.precision, ttl_s=ann.ttl_s, counters=counters,
                                     uploads=uploads)
        self.stored = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvwarm-ring-{ann.pid}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        """Whether the drain has ended (its engine gone and every record stored, or stopped)."""
        return not self._thread.is_alive()

    def _run(self) -> None:
        lower_this_thread()
        try:
            while not self._stop.is_set():
                got = 0
                for record in self.reader.poll(BATCH):
                    got += 1
                    try:
                        self._store(record)
                    except Exception:
                        log.exception("kvwarm node: write-back of a block from engine pid %d failed", self.ann.pid)
                        self.counters.add("write_back_dropped", reason="error")
                    finally:
                        self.reader.release(record)
                if got:
                    continue
                if self.reader.finished():
                    log.info("kvwarm node: engine pid %d is gone and its ring is drained; removing %s",
                             self.ann.pid, self.ann.ring)
                    self.ring.unlink()
                    return
                if not self.reader.wait(0.2):
                    continue
                self._stop.wait(0.001)  # a slot still being written: look again shortly
        finally:
            if self.reader.discarded:  # slots a killed engine left unfinished
                self.counters.add("write_back_dropped", self.reader.discarded, reason="engine_gone")
            self.ring.close()

    def _root(self, namespace: str, chain: int, tenant: Tenant) -> KeyRoot:
        root = self._roots.get((namespace, chain))
        if root is None:
            identity = self.ann.identities[chain] if chain in (0, 1) else None
            if identity is None:
                raise ValueError(f"chain {chain}: the engine announced no such identity")
            root = identity.key_root(self.ann.precision, self.ann.kv_block, tenant.salt)
            self._roots[(namespace, chain)] = root
        return root

    def _store(self, record: Record) -> None:
        m = record.meta
        if m.precision_id != self._pid or m.layer_count != self.ann.layers or m.token_count != self.ann.kv_block:
            self.counters.add("write_back_dropped", reason="invalid")
            log.warning("kvwarm node: a record of engine pid %d is not of the precision or shape it announced",
                        self.ann.pid)
            return
        tenant = self.credentials(m.namespace)
        if tenant is None:
            self.counters.add("write_back_dropped", reason="no_credentials")
            return
        root = self._root(m.namespace, m.chain, tenant)
        tokens, layers, k_errors, v_errors = read_block(record, self.ann)
        if chain_key(m.parent_key, tokens) != m.key:
            self.counters.add("write_back_dropped", reason="invalid")
            log.warning("kvwarm node: a record of engine pid %d names key %s, which is not its tokens' chain key",
                        self.ann.pid, m.key)
            return
        block = Block(0, m.key, m.parent_key, tokens)
        if self.blocks.write(tenant, m.namespace, root, block, layers, k_errors, v_errors,
                             created_at=m.created_ns / 1e9 if m.created_ns else None,
                             what=f" from engine pid {self.ann.pid}"):
            self.stored += 1

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop draining (what is left stays in the ring, for the next node) and close the ring."""
        self._stop.set()
        self._thread.join(timeout_s)

