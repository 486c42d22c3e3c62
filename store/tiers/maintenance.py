"""Housekeeping over a store's tiers: verify every snapshot and owner record, and garbage-collect.

These walk whole tiers, so they are admin operations (``prefill store verify|gc``, the
GC flow), not part of the serving path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

import pyarrow as pa

from store.errors import SnapshotError, SnapshotMismatch, StoreRecordInvalid
from store.format.header import Layout
from store.format.snapshot import read_snapshot
from store.identity.tenant import Tenant
from store.tiers.base import Tier, object_name, parse_object_name
from store.tiers.crypto import is_sealed, plaintext
from store.tiers.owners import parse_owner_record, record_name
from store.tiers.store import Store

log = logging.getLogger("kvwarm.store")


@dataclass
class VerifyReport:
    """What :func:`verify` found."""

    checked: int = 0
    ok: int = 0
    skipped_encrypted: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (location, reason)
    quarantined: list[str] = field(default_factory=list)
    #: (location, reason) of sound snapshots whose layout differs from their parent's: a lookup
    #: stops before them (each file is sound, so none is quarantined, and ``clean`` ignores them)
    mixed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Every snapshot file is sound (and so is the index)."""
        return not self.bad


#: what a chain's blocks must share (:func:`store.serving.mapper.same_geometry`): layout and precision
Geometry = tuple[Layout, str]


def check_object(tier: Tier, name: str, tenants: Mapping[str, Tenant] = {},
                 geometry: dict[str, tuple[str, Geometry]] | None = None) -> str | None:
    """Fully check one stored object. Returns ``None`` when it is sound, else the reason.

    Sound means: readable, both header copies agree, checksums match, the header's layout,
    precision and parts agree (:func:`store.format.geometry.check_geometry`), the key is the
    hash of the header's parent and tokens, and the object sits under its own key
    and tenant (a snapshot copied under another name is caught here).

    ``geometry``: where a sound snapshot's key, parent and geometry are noted (key ->
    (parent key, geometry)), for :func:`mixed_chains`.
    """
    ns, key = parse_object_name(name)
    location = tier.describe(name)
    src = tier.read(name)
    if src is None:
        return None  # removed meanwhile: nothing to judge
    try:
        secret = tenants[ns].encryption_key if ns in tenants else None
        if secret is None and isinstance(src, pa.Buffer) and is_sealed(memoryview(src)):
            return "encrypted"  # cannot be judged without the tenant's key: skipped, not bad
        src = plaintext(src, secret, name, location=location)
        snap = read_snapshot(src, location=location, full=True)
        try:
            if snap.header.key != key:
                raise SnapshotMismatch(f"file is named {key} but holds {snap.header.key}", location=location)
            if snap.header.tenant != ns:
                raise SnapshotMismatch(f"file is in namespace {ns!r} but labelled {snap.header.tenant!r}", location=location)
            if geometry is not None:
                h = snap.header
                geometry[f"{ns}/{key}"] = (f"{ns}/{h.parent_key}", (h.layout, h.precision.scheme_id()))
        finally:
            snap.close()
    except SnapshotError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def mixed_chains(geometry: Mapping[str, tuple[str, Geometry]]) -> list[tuple[str, str]]:
    """``(namespace/key, reason)`` of each snapshot whose geometry differs from its parent's
    (both noted by :func:`check_object` in one tier). Each file is sound alone, so neither is
    quarantined; a lookup cuts such a chain before the child."""
    out = []
    for key, (parent, mine) in geometry.items():
        theirs = geometry.get(parent)
        if theirs is not None and theirs[1] != mine:
            (lay, scheme), (plain, pscheme) = mine, theirs[1]
            out.append((key, f"layout {lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim} {scheme} differs "
                             f"from its parent's {plain.num_layers}x{plain.num_kv_heads}x{plain.head_dim} "
                             f"{pscheme}: a lookup stops before it"))
    return out


def index_repair(store: Store, tier: Tier, report: VerifyReport) -> None:
    """Report (in ``bad``) and count (``bad_record``) what opening ``tier``'s index found damaged and
    repaired (:func:`store.tiers.repair.repair`; the index was rebuilt from the files)."""
    fix = getattr(getattr(tier, "index", None), "repair", None)
    if fix is None:
        return
    done = f"set aside to {fix.set_aside}" if fix.set_aside else "dropped"
    report.bad.append((fix.path, f"StoreRecordInvalid: the tier's index: {fix.reason}; {done}, and the index "
                                 "rebuilt from the snapshot files"))
    store.stats.incr("bad_record")


def verify(store: Store, *, namespace: str | None = None, tenants: Mapping[str, Tenant] = {},
           quarantine: bool = True) -> VerifyReport:
    """Check every snapshot in every tier (optionally one namespace); quarantine bad ones.

    A snapshot whose layout differs from its parent's in the same tier is reported in ``mixed``
    (not quarantined: each file is sound alone)."""
    report = VerifyReport()
    prefix = f"{namespace}/" if namespace else ""
    for tier in store.tiers:
        index_repair(store, tier, report)
        geometry: dict[str, tuple[str, Geometry]] = {}
        for entry in list(tier.entries(prefix)):
            report.checked += 1
            try:
                reason = check_object(tier, entry.name, tenants, geometry)
            except ValueError as exc:  # a name no writer makes (copied in by hand): reported, left in place
                report.bad.append((f"{tier.url} {entry.name}", f"stray file, not read: {exc}; remove it"))
                store.stats.incr("corrupt")
                continue
            if reason is None:
                report.ok += 1
            elif reason == "encrypted":
                report.skipped_encrypted += 1
            else:
                report.bad.append((tier.describe(entry.name), reason))
                store.stats.incr("corrupt")
                if quarantine:
                    where = tier.quarantine(entry.name, reason)
                    if where:
                        report.quarantined.append(where)
                        store.stats.incr("quarantined")
                log.error("bad snapshot %s: %s", tier.describe(entry.name), reason)
        for key, reason in mixed_chains(geometry):
            ns, _, k = key.partition("/")
            where = tier.describe(object_name(ns, k))
            report.mixed.append((where, reason))
            log.error("snapshot %s: %s", where, reason)
    return report


@dataclass
class GcReport:
    """What :func:`gc` removed or fixed."""

    temp_removed: int = 0
    expired_removed: int = 0
    evicted: int = 0
    remote_expired_removed: int = 0
    index_fixes: dict[str, int] = field(default_factory=dict)
    verify: VerifyReport | None = None

    def as_dict(self) -> dict[str, object]:
        d = {k: v for k, v in self.__dict__.items() if k != "verify"}
        if self.verify is not None:
            d["verify"] = {"checked": self.verify.checked, "bad": len(self.verify.bad),
                           "quarantined": len(self.verify.quarantined)}
        return d


def gc(store: Store, *, now: float | None = None, ttl_max_s: float | None = None, verify_all: bool = False,
       tenants: Mapping[str, Tenant] = {}) -> GcReport:
    """Collect garbage.

    Capped tiers (the local one) keep each snapshot's expiry: their housekeeping removes
    temp files left by dead writers, index drift, expired snapshots and anything over
    the cap (LRU order). Other tiers (S3): objects older than ``ttl_max_s`` (the TTL
    policy's upper bound, so they are certainly expired; no GET needed).
    With ``verify_all``, every snapshot is also checked and bad ones quarantined.
    """
    now = store.clock() if now is None else now
    report = GcReport()
    for tier in store.tiers:
        if tier.capped:
            done = tier.housekeep(now)
            report.temp_removed += done.temp_removed
            report.index_fixes = done.index_fixes
            report.expired_removed += done.expired_removed
            report.evicted += done.evicted
        elif ttl_max_s is not None:
            for entry in list(tier.entries()):
                if entry.mtime and entry.mtime + ttl_max_s <= now:
                    report.remote_expired_removed += tier.delete(entry.name)
    if verify_all:
        report.verify = verify(store, tenants=tenants)
    return report


def check_owner_records(store: Store, *, namespace: str | None = None) -> list[tuple[str, str]]:
    """Every namespace owner record (``meta/tenants/<ns>.json``) in every tier that fails validation
    (:func:`store.tiers.owners.parse_owner_record`), as ``(location, reason)``; counted as ``bad_record``.
    A damaged record is left where it is: lookups in its namespace miss and writes there are refused
    until an operator restores or removes it. A tier that cannot be listed raises ``StoreUnavailable``."""
    bad: list[tuple[str, str]] = []
    for tier in store.tiers:
        for meta in tier.list_meta(record_name(namespace) if namespace else "tenants/"):
            ns = meta[len("tenants/"):].removesuffix(".json")
            location = f"{tier.url} meta/{meta}"
            if "/" in ns or not meta.endswith(".json"):
                continue  # not an owner record (nothing else is kept there today)
            raw = tier.get_meta(meta)
            if raw is None:
                continue  # removed meanwhile
            try:
                parse_owner_record(raw, ns, location)
            except StoreRecordInvalid as exc:
                bad.append((location, str(exc)))
                store.stats.incr("bad_record")
                log.error("bad owner record: %s", exc)
    return bad
