"""The last step of write-back, shared by the engine's own writer and the node's: one computed block,
already quantised, onto NVMe and into the upload backlog.

:class:`store.engines.vllm.writeback.WriteBack` calls it on its thread when it writes in the engine
(``loader.write_back_via = engine``, or while no node takes the engine's ring), and the node's
:class:`store.node.writer.RingDrain` for each block an engine handed it through its ring. Both name
and lay out a block the same way (:func:`store.format.encode.encode_snapshot`, no second
quantisation), so a block is the same object whichever process writes it: a block the tier holds
already is skipped (``write_back_skipped:present``), which also makes a record read twice (a node
restarted before it released it) harmless.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from store.errors import StoreError
from store.format.encode import StoredLayer, encode_snapshot
from store.format.header import WRITE_BACK
from store.format.precision import Precision
from store.identity.keys import Block, KeyRoot
from store.identity.tenant import Tenant
from store.tiers.base import Tier, object_name
from store.tiers.store import Store

log = logging.getLogger("kvwarm.store")


class Counting(Protocol):
    """Where the writes are counted (:class:`store.engines.vllm.stats.Counters`)."""

    def add(self, name: str, n: float = 1, reason: str | None = None) -> None: ...


class SnapshotWriter:
    """Writes write-back blocks to the node tier and enqueues their uploads.

    Args:
        local: the node tier (NVMe).
        precision: the storage precision the blocks were quantised at.
        ttl_s: the snapshots' lifetime.
        counters: ``written_back_blocks``, ``written_back_bytes``, ``write_back_skipped:present``,
            ``write_back_dropped:error``.
        uploads: the upload backlog's writer side (``put(tenant, snap)``), or ``None``: NVMe only.
        clock: wall time (a block's creation time when its maker did not say).
    """

    def __init__(self, local: Tier, *, precision: Precision, ttl_s: float, counters: Counting,
                 uploads: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.local = local
        self._store = Store([local])
        self.precision = precision
        self.ttl_s = ttl_s
        self.counters = counters
        self.uploads = uploads
        self.clock = clock

    def write(self, tenant: Tenant, namespace: str, root: KeyRoot, block: Block, layers: Sequence[StoredLayer],
              k_errors: Sequence[float], v_errors: Sequence[float], *, created_at: float | None = None,
              what: str = "") -> bool:
        """Write one block (``layers``: per layer its stored K, V and scales) under ``namespace``; whether it
        was written (``False``: the tier holds it already, or it could not be written, both counted).

        Raises:
            ValueError: the layers do not match the block or the precision (a bug: counted by the caller).
        """
        if self.local.exists(object_name(namespace, block.key)):
            self.counters.add("write_back_skipped", reason="present")
            return False
        snap = encode_snapshot(root=root, block=block, tenant=namespace, layers=layers,
                               errors={"k_rel_l2": list(k_errors), "v_rel_l2": list(v_errors)},
                               precision=self.precision, created_at=self.clock() if created_at is None else created_at,
                               ttl_s=self.ttl_s, source=WRITE_BACK)
        try:
            wrote = self._store.put(tenant, snap)
        except StoreError as exc:  # full, refused: this block is not written
            log.warning("kvwarm write-back of a block%s failed: %s", what, exc)
            self.counters.add("write_back_dropped", reason="error")
            return False
        if not wrote:
            self.counters.add("write_back_skipped", reason="present")
            return False
        self.counters.add("written_back_blocks")
        self.counters.add("written_back_bytes", snap.file_size)
        if self.uploads is not None:
            self.uploads.put(tenant, snap)  # waits in the upload backlog until the link takes it
        return True

    def close(self) -> None:
        """Release the tier's handle."""
        self._store.close()
