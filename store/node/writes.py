"""Every engine's write-back, in the node: their rings' drains and the upload threads behind them.

:meth:`NodeWrites.attach` starts a :class:`store.node.writer.RingDrain` for an announced ring (once
per ring file: an engine that announces again after a node restart is drained by the new node).
The upload threads (:class:`store.engines.vllm.uploads.Uploads` over the node tier's persistent
backlog, ``loader.write_back_streams`` of them) start with the node, where the store has remote
tiers: they drain the backlog, also what engines wrote themselves while no node took their ring.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from store.config import KvwarmConfig
from store.engines.vllm.stats import Counters
from store.engines.vllm.uploads import Uploads
from store.errors import StoreError
from store.identity.tenant import PUBLIC, Tenant
from store.node.block_record import Announcement
from store.node.writer import RingDrain
from store.tiers.base import Tier
from store.tiers.store import Store

log = logging.getLogger("kvwarm.node")


class NodeWrites:
    """The node's write-back side.

    Args:
        config: the node's configuration (``loader.write_back_*``, ``loader.s3_backoff_s``).
        store: every tier, the node tier first.
        local: the node tier.
        tenants: the credentials of the configured tenants the node holds, by namespace (a configured
            tenant missing here has a secret this process lacks: the engines write its blocks themselves).
    """

    def __init__(self, config: KvwarmConfig, store: Store, local: Tier, tenants: Mapping[str, Tenant]) -> None:
        self.config = config
        self.store = store
        self.local = local
        self.tenants = dict(tenants)
        self.counters = Counters()
        self._drains: dict[str, RingDrain] = {}
        self._lock = threading.RLock()
        self.uploads: Uploads | None = None
        if len(store.tiers) > 1:  # from the start: what engines wrote themselves waits in the backlog too
            lc = config.loader
            self.uploads = Uploads(Store(store.tiers[1:]), local, streams=lc.write_back_streams,
                                   max_bytes=int(lc.write_back_queue_bytes), backoff_s=lc.s3_backoff_s,
                                   counters=self.counters, credentials=self._credentials, tenants={*tenants, PUBLIC})

    def attach(self, ann: Announcement) -> dict[str, Any]:
        """Drain ``ann``'s ring (from now on, in the background); the namespaces the node writes for.

        Raises:
            FileNotFoundError, RingFormatMismatch, RingBusy: the ring cannot be read.
        """
        with self._lock:
            drain = self._drains.get(ann.ring)
            if drain is None or drain.done:
                if self.uploads is not None:
                    self.uploads.add_tenants([t for t in ann.tenants if self.credentials(t) is not None])
                self._drains[ann.ring] = RingDrain(ann, self.local, self.credentials, self.counters, self.uploads)
                log.info("kvwarm node: draining engine pid %d's write-back ring %s", ann.pid, ann.ring)
            for path in [p for p, d in self._drains.items() if d.done and p != ann.ring]:
                del self._drains[path]
        return {"refused": sorted(set(self.config.tenants) - set(self.tenants))}

    def credentials(self, name: str) -> Tenant | None:
        """``name``'s credentials (as the engine derives them), or ``None`` where this process lacks its secret."""
        got = self.tenants.get(name)
        if got is None and name not in self.config.tenants:
            try:
                got = self.config.tenant(name)
            except StoreError:
                return None
            with self._lock:
                self.tenants[name] = got
        return got

    def _credentials(self, name: str) -> Tenant:
        got = self.credentials(name)
        return got if got is not None else self.config.tenant(name)  # raises, naming what is missing

    def stats(self) -> dict[str, Any]:
        """The write-back counters (since start) and the rings being drained."""
        with self._lock:
            drains = list(self._drains.values())
        return {**self.counters.totals(), "rings": sum(1 for d in drains if not d.done),
                "ring_discarded": sum(d.reader.discarded for d in drains)}

    def drain(self, deadline: float) -> bool:
        """Wait until the uploads are done (monotonic ``deadline``); whether they are."""
        return self.uploads is None or self.uploads.drain(deadline)

    def close(self) -> None:
        """Stop every drain (what is left stays in the rings) and the uploads (what is left stays in the backlog)."""
        with self._lock:
            drains, self._drains = list(self._drains.values()), {}
        for d in drains:
            d.stop()
        if self.uploads is not None:
            self.uploads.close()
