"""This process's mappings of the node's pooled snapshots: map a chain from the local tier, pin it.

A :class:`PoolMapper` maps each snapshot of a chain through the store's read path
(local tiers only: the hot path never waits on the network), checks its payload only
when it first enters the node's pool, pins the chain in the pool, and keeps the
mappings for later lookups until the pool evicts them (its epoch moves). The loader
turns what it pinned into a :class:`store.serving.hit.LoaderHit`; an engine adapter
that maps blocks from the pool can use it the same way.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from store.format.snapshot import Snapshot
from store.identity.keys import Block
from store.identity.tenant import Tenant
from store.miss import MissReason
from store.serving.fetch import Scope
from store.serving.metrics import LoaderMetrics
from store.serving.pool import Admit, SnapshotPool
from store.tiers.store import Store

log = logging.getLogger("kvwarm.loader")


def _geometry(snap: Snapshot) -> str:
    lay, prec = snap.header.layout, snap.header.precision
    return (f"{lay.num_layers}-layer, {lay.num_kv_heads}-head, {lay.head_dim}-dim, {lay.block_size}-token "
            f"{prec.scheme_id()}")


def same_geometry(first: Snapshot, other: Snapshot) -> bool:
    """Whether ``other`` has ``first``'s layout and storage precision, and so (its header checked
    by :func:`store.format.geometry.check_geometry`) the same parts in the same dtypes and shapes:
    what every snapshot of one hit must share. (The precision is the key root's for every block a
    lookup reads; the layout is not part of the key.)"""
    a, b = first.header, other.header
    return a.layout == b.layout and a.precision.scheme_id() == b.precision.scheme_id()


@dataclass(frozen=True)
class Pinned:
    """What :meth:`PoolMapper.map_and_pin` pinned: a leading part of the chain asked for."""

    snapshots: list[Snapshot]
    names: list[str]
    admissions: list[int]
    all_pooled: bool  # every one was in the node's pool already
    stop: MissReason | None  # why it stopped short of the chain asked for


class PoolMapper:
    """Maps chains from ``store``'s first (mappable) tier and pins them in ``pool``.

    Args:
        store: the loader's store; its first tier is mapped.
        tenant: whose snapshots (the store checks every namespace against it).
        pool: the node's shared pool.
        metrics: counts the bytes newly mapped and the pool's gauges.
        verify_payload: check payload checksums when a snapshot first enters the pool.
        clock: time source for TTLs.
    """

    def __init__(self, store: Store, tenant: Tenant, pool: SnapshotPool, metrics: LoaderMetrics, *,
                 verify_payload: bool, clock: Callable[[], float]) -> None:
        self.store = store
        self.local = store.tiers[0]
        self.tenant = tenant
        self.pool = pool
        self.metrics = metrics
        self.verify_payload = verify_payload
        self.clock = clock
        #: retention priority of object names in the pool (plan scores, from prefetch)
        self.priority: dict[str, float] = {}
        self._lock = threading.Lock()
        self._mapped: dict[str, tuple[int, Snapshot, int]] = {}  # name -> (admission id, mapping, file bytes)
        self._epoch = -1

    def prioritise(self, chains: Iterable[tuple[Sequence[Block], float | None, Scope]]) -> None:
        """A plan's ``(chain, score, scope)``: each score becomes its blocks' retention priority, in
        place of the last plan's (a node re-prefetching a plan every few minutes keeps one plan's
        priorities, not every entry it was ever given); a block in several chains takes the highest."""
        priority: dict[str, float] = {}
        for chain, score, scope in chains:
            if score is None:
                continue
            for name in scope.names(chain):
                priority[name] = max(score, priority.get(name, score))
        self.priority = priority

    def __len__(self) -> int:
        """Snapshots this process keeps mapped."""
        return len(self._mapped)

    def reconcile(self) -> None:
        """Drop this process's mappings of snapshots evicted from the pool by anyone."""
        epoch = self.pool.epoch()
        if epoch == self._epoch:
            return
        with self._lock:
            names = list(self._mapped)
        present = self.pool.admissions(names) if names else {}  # nothing mapped: nothing to drop
        with self._lock:
            for name in names:
                cached = self._mapped.get(name)
                if cached is not None and present.get(name) != cached[0]:
                    del self._mapped[name]  # unmapped when the last view of it goes
            self._epoch = epoch

    def map_and_pin(self, blocks: Sequence[Block], scope: Scope) -> Pinned:
        """Map ``blocks`` (in order, stopping at the first that cannot be served) and pin them."""
        names = scope.names(blocks)
        in_pool = self.pool.admissions(names)
        now = self.clock()
        snaps: list[Snapshot] = []
        sizes: list[int] = []
        stop: MissReason | None = None
        all_pooled = True
        for block, name in zip(blocks, names):
            with self._lock:
                cached = self._mapped.get(name)
            if cached is not None and in_pool.get(name) == cached[0]:
                snap, size = cached[1], cached[2]
            else:
                all_pooled &= name in in_pool
                # The payload is checked once per node, when it enters the pool; the kernel reads
                # ahead a snapshot about to be used that no process has mapped (a pooled one is in
                # the page cache: the advice would only walk its pages, ~25 us a snapshot).
                pooled = name in in_pool
                found = self.store.read(self.tenant, block, scope.root, now=now, local_only=True,
                                        verify=self.verify_payload and not pooled, readahead=not pooled)
                if found.snapshot is None:
                    stop = found.miss  # absent: evicted from NVMe since the probe
                    break
                snap, size = found.snapshot, found.size
                self.metrics.mapped(size)
            if snap.header.expired(now):
                stop = MissReason.EXPIRED
                break
            if snaps and not same_geometry(snaps[0], snap):
                # Each snapshot is sound alone, but a hit is one layout: engines copy every
                # block into caches shaped by the first. The rest of the chain is a miss.
                log.warning("%s holds a %s snapshot after a %s one; the hit stops before it", name,
                            _geometry(snap), _geometry(snaps[0]))
                stop = MissReason.MISMATCH
                break
            snaps.append(snap)
            sizes.append(size)
        if not snaps:
            return Pinned([], [], [], all_pooled, stop)
        ids = self.pool.pin([Admit(n, str(self.local.path(n)), size, s.header.expires_at, self.priority.get(n))
                             for n, s, size in zip(names, snaps, sizes)])
        if len(ids) < len(snaps):
            stop = MissReason.POOL_FULL
        with self._lock:
            for name, adm, snap, size in zip(names, ids, snaps, sizes):
                self._mapped[name] = (adm, snap, size)
        self.metrics.pool(self.pool.last_usage, self.pool.last_budget)
        return Pinned(snaps[: len(ids)], names[: len(ids)], ids, all_pooled, stop)

    def clear(self) -> None:
        """Drop every mapping (each goes when its last view does)."""
        with self._lock:
            self._mapped.clear()
