"""The tiered snapshot store: what prefill jobs write to and serving nodes read from.

Tiers are ordered fastest first (NVMe, then S3). Reads go through them in order; a
hit in a remote tier is copied into the first, local one atomically (read-through).
Writes go to every tier. Every call names a tenant (its credentials): the key root's
salt picks the namespace (the tenant's own, or ``public``), and a namespace records the
salt id of its owner, so a caller holding the wrong secret is refused and counted. Tenants
read ``public``; only its writer writes or deletes there (:mod:`store.tiers.owners`).

:meth:`Store.read` is the one read path: the loader's hot path uses it too, asking only
the local tiers (``local_only``) and checking payloads only where it says (``verify``).
A miss says why (:class:`store.miss.MissReason`).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence, TypeVar

import pyarrow as pa

from store.config import KvwarmConfig, load_config
from store.errors import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotMismatch,
    StoreError,
    StoreFull,
    StoreUnavailable,
    TenantAccessDenied,
)
from store.format.encode import EncodedSnapshot, snapshot_bytes
from store.format.header import SnapshotHeader
from store.format.snapshot import Snapshot, read_header, read_snapshot
from store.identity.keys import Block, BlockKey, KeyRoot, check_key
from store.identity.tenant import PUBLIC, PUBLIC_TENANT, Tenant
from store.miss import MissReason, reason_of
from store.tiers.answers import Listed, Probe, Read
from store.tiers.base import Tier, object_name
from store.tiers.crypto import plaintext, seal
from store.tiers.owners import Owners
from store.tiers.registry import tiers_from_url
from store.tiers.stats import StoreStats

log = logging.getLogger("kvwarm.store")
T = TypeVar("T")


class Store:
    """Tiered, tenant-isolated snapshot store.

    Args:
        tiers: fastest first; read-through copies remote hits into the first when it is local.
        clock: time source for TTL checks.
    """

    def __init__(self, tiers: Sequence[Tier], *, clock: Callable[[], float] = time.time) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = list(tiers)
        self.clock = clock
        self.stats = StoreStats()
        self.owners = Owners(self.tiers, self.stats)

    @classmethod
    def open(cls, url: str | None = None, config: KvwarmConfig | None = None, *, create_bucket: bool = False) -> "Store":
        """Open the store named by ``url`` (default: the config's ``store.url``)."""
        config = config or load_config()
        return cls(tiers_from_url(url or config.store.url, config.store, create_bucket=create_bucket))

    @property
    def local(self) -> Tier | None:
        """The first tier when it is local (not ``remote``): where remote hits are read through."""
        first = self.tiers[0]
        return None if first.remote else first

    # -- tenancy -------------------------------------------------------------
    def _refuse(self, tenant: Tenant, what: str) -> TenantAccessDenied:
        return self.owners.refuse(tenant, what)

    def _namespace_of(self, tenant: Tenant, salt_id: str, what: str) -> str:
        if salt_id == tenant.salt_id:
            return tenant.name
        if salt_id == PUBLIC_TENANT.salt_id:
            return PUBLIC
        raise self._refuse(tenant, f"{what} with a key root salted for another tenant")

    def warm_up(self, tenant: Tenant, namespaces: Sequence[str]) -> None:
        """Ahead of the first read: open each remote tier's connection and read the owners of
        ``namespaces`` there (cached), so that a first fetch pays neither. Best effort: a
        tier that cannot be reached is logged and left to the reads (which count it)."""
        for i, tier in enumerate(self.tiers):
            if not tier.remote:
                continue
            for ns in namespaces:
                if ns not in (tenant.name, PUBLIC):
                    raise self._refuse(tenant, f"warm up namespace {ns!r}")
                try:
                    self.owners.record(i, ns)
                except (StoreError, OSError) as exc:
                    log.warning("warming up %s failed (the first read will try again): %s", tier.url, exc)
                    break

    def _guard(self, tenant: Tenant, ns: str, what: str, i: int) -> None:
        self.owners.guard(tenant, ns, what, i)

    # -- writes --------------------------------------------------------------
    def put(self, tenant: Tenant, snap: EncodedSnapshot) -> bool:
        """Write a snapshot to every tier (skipping tiers that already hold it).

        Returns ``True`` if any tier was written. Raises :class:`TenantAccessDenied`
        (counted) for a snapshot salted for another tenant, and for a ``public`` one from
        anyone but the public writer (:class:`store.tiers.owners.Owners`);
        :class:`StoreRecordInvalid` when a tier's owner record of the namespace is damaged
        (never claimed again); :class:`StoreUnavailable` when a tier cannot be reached,
        :class:`StoreFull` when it cannot fit locally.
        """
        ns = self._namespace_of(tenant, snap.header.salt_id, "write")
        if snap.header.tenant != ns:
            raise self._refuse(tenant, f"write a snapshot labelled for tenant {snap.header.tenant!r}")
        name = object_name(ns, snap.key)
        wrote = False
        for i in range(len(self.tiers)):
            # Every tier's owner is checked before anything is written: a refused writer
            # must not claim a fresh node's local namespace on its way to being refused.
            self.owners.guard(tenant, ns, "write to", i, write=True)
        for i, tier in enumerate(self.tiers):
            self.owners.claim(tenant, ns, i)
            if tier.stores_encoded:
                wrote |= tier.write(name, snap, expires_at=snap.header.expires_at)
            elif not tier.exists(name):
                data = snapshot_bytes(snap)
                if tenant.encryption_key is not None and ns == tenant.name:
                    data = seal(tenant.encryption_key, name, data)
                wrote |= tier.write(name, data, expires_at=snap.header.expires_at)
        self.stats.incr("writes" if wrote else "writes_skipped")
        return wrote

    # -- reads ---------------------------------------------------------------
    def _ask(self, tenant: Tenant, ns: str, what: str, i: int, call: Callable[[Tier], T]) -> T | StoreUnavailable:
        """Check the caller may ``what`` in tier ``i``, then call it. An unreachable tier
        is counted and logged, and its error returned (not raised): the next tier may answer."""
        try:
            self._guard(tenant, ns, what, i)
            return call(self.tiers[i])
        except StoreUnavailable as exc:
            self.stats.incr("unavailable")
            log.warning("%s", exc)
            return exc

    def probe(self, tenant: Tenant, blocks: Sequence[Block | BlockKey], root: KeyRoot, *,
              local_only: bool = False) -> Probe:
        """How many leading ``blocks`` (or bare keys) exist in the longest-holding tier (existence only:
        :meth:`read` validates each one). One round trip per tier at most; with
        ``local_only``, remote tiers are not asked (the serving hot path)."""
        if not blocks:
            return Probe(0, None)
        ns = self._namespace_of(tenant, root.salt_id, "probe")
        names = [object_name(ns, b if isinstance(b, str) else b.key) for b in blocks]
        best = Probe(0, None)
        down: list[str] = []
        for i, tier in enumerate(self.tiers):
            if local_only and tier.remote:
                continue
            n = self._ask(tenant, ns, "probe", i, lambda t: t.probe(names))
            if isinstance(n, StoreUnavailable):
                down.append(tier.kind)
                continue
            if n > best.count:
                best = Probe(n, tier.kind)
            if n == len(names):
                break
        return Probe(best.count, best.tier, tuple(down)) if down else best

    def read(self, tenant: Tenant, block: Block | BlockKey, root: KeyRoot, *, now: float | None = None,
             verify: bool = True, local_only: bool = False, readahead: bool = False,
             read_through: bool = True) -> Read:
        """The snapshot of exactly ``block`` under ``root``, or why there is none.

        ``block`` may be a bare key (a copy by key, as a node warming from the fleet's
        memory makes): its snapshot's identity is checked, not its tokens, which the lookup
        that maps it checks (:meth:`store.format.header.SnapshotHeader.check_identity`).

        Tiers are asked fastest first (only local ones with ``local_only``). An expired
        snapshot is a miss. A corrupt or mismatched one is quarantined, counted, and the
        next tier is tried; an unreachable tier is counted and the next one tried. A miss
        says why, with the error behind it: a copy refused (the last one met: ``corrupt``,
        ``mismatch``, ``unknown_version``, ``undecryptable``), else an unreachable tier
        (``store_unavailable``), else ``expired`` or ``absent``.

        Args:
            now: the time TTLs are checked against (default: the store's clock).
            verify: check the payload's checksums (headers are always checked); the
                loader checks a snapshot once, when it first enters the node's pool.
            readahead: the snapshot is about to be used whole (a mapped file is read ahead).
            read_through: copy a remote hit into the local tier now; ``False`` answers it from
                memory with its bytes in ``source``, for :meth:`land` to write later (a caller
                that fetches several blocks at once and lands them in prefix order).

        Raises:
            TenantAccessDenied: ``root`` is salted for another tenant, or the namespace's
                owner holds another secret (counted).
        """
        ns = self._namespace_of(tenant, root.salt_id, "read")
        name = object_name(ns, block if isinstance(block, str) else block.key)
        now = self.clock() if now is None else now
        failed: Read | None = None
        expired = False
        for i, tier in enumerate(self.tiers):
            if local_only and tier.remote:
                continue
            src = self._ask(tenant, ns, "read", i, lambda t: t.read(name, readahead=readahead))
            if isinstance(src, StoreUnavailable):
                failed = failed or Read(None, MissReason.STORE_UNAVAILABLE, error=src)
                continue
            if src is None:
                continue
            location = tier.describe(name)
            try:
                src = self._plaintext(tenant, ns, name, src, location)
                snap = read_snapshot(src, location=location, verify_payload=verify)
                if isinstance(block, str):
                    snap.header.check_identity(block, root, location=location)
                else:
                    snap.header.check_matches(block, root, location=location)
            except SnapshotError as exc:
                src = None  # the mapping of a file we refuse must not outlive the refusal
                failed = Read(None, self._bad(tier, name, exc), error=exc)  # every bad copy is counted
                continue
            if snap.header.expired(now):
                self.stats.incr("expired")
                snap.close()
                expired = True
                continue
            size = src.size
            self.stats.incr("hits")
            if i > 0 and not read_through:
                return Read(snap, tier=tier.kind, size=size, source=src)
            if i > 0:
                snap = self._read_through(name, src, snap)
            return Read(snap, tier=tier.kind, size=size)
        self.stats.incr("misses")
        return failed or Read(None, MissReason.EXPIRED if expired else MissReason.ABSENT)

    def get(self, tenant: Tenant, block: Block, root: KeyRoot, *, now: float | None = None) -> Snapshot | None:
        """The snapshot of exactly ``block`` under ``root``, or ``None`` on a miss
        (:meth:`read`, payload checked, every tier).

        Raises:
            SnapshotCorrupt, SnapshotMismatch, UnknownFormatVersion, SnapshotError: no
                tier served the block and one held it in that state (quarantined where
                corrupt or mismatched).
            StoreUnavailable: no tier served the block and one that might hold it could
                not be reached.
            TenantAccessDenied: as for :meth:`read`.
        """
        found = self.read(tenant, block, root, now=now)
        if found.error is not None:
            raise found.error
        return found.snapshot

    @staticmethod
    def _plaintext(tenant: Tenant, ns: str, name: str, src: pa.Buffer | pa.NativeFile, location: str) -> pa.Buffer | pa.NativeFile:
        """Decrypt an object sealed for this tenant (public objects are never sealed)."""
        return plaintext(src, tenant.encryption_key if ns == tenant.name else None, name, location=location)

    def _bad(self, tier: Tier, name: str, exc: SnapshotError) -> MissReason:
        """Count a refused object (quarantined when corrupt or mismatched); its miss reason."""
        reason = reason_of(exc)  # undecryptable: sound, but sealed for a key this node lacks
        kind = "mismatched" if reason is MissReason.MISMATCH else reason.value
        self.stats.incr(kind)
        if isinstance(exc, (SnapshotCorrupt, SnapshotMismatch)):
            where = tier.quarantine(name, f"{type(exc).__name__}: {exc}")
            if where:
                self.stats.incr("quarantined")
            log.error("%s snapshot quarantined to %s: %s", kind, where, exc)
        else:
            log.error("snapshot refused: %s", exc)
        return reason

    def land(self, tenant: Tenant, block: Block | BlockKey, root: KeyRoot, found: Read) -> Read:
        """Write a remote hit that :meth:`read` answered with ``read_through=False`` into the
        local tier (as its read-through would have); what is served from then on.

        A failed write (the tier full, a disk error) is logged and the snapshot served from
        memory, as in a read-through. ``found`` without ``source`` is returned as it is.
        """
        if found.snapshot is None or found.source is None:
            return found
        ns = self._namespace_of(tenant, root.salt_id, "read")
        name = object_name(ns, block if isinstance(block, str) else block.key)
        snap = self._read_through(name, found.source, found.snapshot)
        return Read(snap, tier=found.tier, size=found.size)

    def _read_through(self, name: str, src: pa.Buffer, snap: Snapshot) -> Snapshot:
        local = self.local
        if local is None:
            return snap
        try:
            local.write(name, src, expires_at=snap.header.expires_at)
        except (StoreFull, OSError) as exc:
            log.warning("read-through of %s into the local tier failed (%s); serving from memory", name, exc)
            return snap
        self.stats.incr("read_through")
        mapped = local.read(name)
        if mapped is None:  # evicted in between by another process
            return snap
        try:
            return read_snapshot(mapped, location=local.describe(name), verify_payload=False)
        except SnapshotError:
            return snap

    # -- listing and admin ---------------------------------------------------
    def list(self, tenant: Tenant, namespace: str | None = None) -> list[Listed]:
        """Snapshots of ``namespace`` (default: the tenant's own; ``"public"`` allowed)."""
        ns = namespace or tenant.name
        if ns not in (tenant.name, PUBLIC):
            raise self._refuse(tenant, f"list namespace {ns!r}")
        merged: dict[str, tuple[int, list[str]]] = {}
        for i, tier in enumerate(self.tiers):
            self._guard(tenant, ns, "list", i)
            for e in tier.entries(f"{ns}/"):
                key = e.name.rsplit("/", 1)[-1].split(".")[0]
                size, where = merged.get(key, (e.size, []))
                where.append(tier.kind)
                merged[key] = (size, where)
        return [Listed(k, s, tuple(w)) for k, (s, w) in sorted(merged.items())]

    def stat(self, tenant: Tenant, key: str, namespace: str | None = None) -> tuple[SnapshotHeader, list[str]] | None:
        """The header of a snapshot and the tiers holding it, or ``None`` if no tier has it.

        Reads only the header (checksummed) from the fastest tier that holds it.
        """
        ns = namespace or tenant.name
        if ns not in (tenant.name, PUBLIC):
            raise self._refuse(tenant, f"stat in namespace {ns!r}")
        name = object_name(ns, check_key(key))
        header: SnapshotHeader | None = None
        where: list[str] = []
        for i, tier in enumerate(self.tiers):
            self._guard(tenant, ns, "stat in", i)
            if not tier.exists(name):
                continue
            where.append(tier.kind)
            if header is None:
                src = tier.read(name)
                if src is not None:
                    src = self._plaintext(tenant, ns, name, src, tier.describe(name))
                    header = read_header(src, location=tier.describe(name))
        return (header, where) if header is not None else None

    def delete(self, tenant: Tenant, key: str, namespace: str | None = None) -> int:
        """Remove a snapshot from every tier; returns how many tiers held it.

        Raises:
            TenantAccessDenied: (counted) another tenant's namespace, or ``public`` from anyone but
                its writer (checked in every tier before any is touched).
            StoreRecordInvalid: a tier's owner record of the namespace is damaged.
        """
        ns = namespace or tenant.name
        if ns not in (tenant.name, PUBLIC):
            raise self._refuse(tenant, f"delete from namespace {ns!r}")
        name = object_name(ns, check_key(key))
        for i in range(len(self.tiers)):
            self.owners.guard(tenant, ns, "delete from", i, write=True)
        return sum(tier.delete(name) for tier in self.tiers)

    def close(self) -> None:
        """Flush access records and release tiers."""
        for tier in self.tiers:
            tier.close()
