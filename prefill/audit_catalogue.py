"""What the audit knows of a store before it computes anything: every snapshot's header, its chain, the sample.

:func:`catalogue` walks every tier (one namespace, or all) and reads each snapshot's header
once, from the first tier that holds it: identity, parent, source, model. :func:`select`
picks what to audit, the ``public`` namespace's snapshots first (every tenant loads them), then
write-back (KV an engine computed and nobody else checked), then snapshots of unknown source,
then the prefill job's, in random order within each source.
:func:`plan_paths` groups the picks by chain: recomputing block ``n`` needs the tokens of
blocks ``0..n``, so one forward over a chain's deepest pick recomputes every pick on it.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import pyarrow as pa

from store.errors import SnapshotError, SnapshotMismatch
from store.format.header import PREFILL, UNKNOWN_SOURCE, WRITE_BACK, SnapshotHeader
from store.format.snapshot import read_header
from store.identity.tenant import PUBLIC, Tenant
from store.tiers.base import Tier, object_name, parse_object_name
from store.tiers.crypto import is_sealed, plaintext
from store.tiers.store import Store

log = logging.getLogger(__name__)

#: The order the audit samples in: KV computed by engines first, the prefill job's last.
SOURCE_ORDER: tuple[str, ...] = (WRITE_BACK, UNKNOWN_SOURCE, PREFILL)


@dataclass(frozen=True)
class Stored:
    """One snapshot (a name, in one or more tiers) as its first readable copy's header describes it."""

    namespace: str
    key: str
    parent_key: str
    root_key: str
    origin: str
    model_fingerprint: str
    adapter_hash: str
    expires_at: float
    tiers: tuple[int, ...]  # indexes into Store.tiers of the tiers listing it

    @property
    def name(self) -> str:
        return object_name(self.namespace, self.key)

    @property
    def is_first(self) -> bool:
        """Block 0 of its chain (its parent is the chain's root)."""
        return self.parent_key == self.root_key


@dataclass
class Catalogue:
    """Every readable snapshot by object name, and what could not be read (``unreadable``, ``encrypted``)."""

    entries: dict[str, Stored] = field(default_factory=dict)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (location, reason)
    encrypted: int = 0

    def descendants(self, names: set[str]) -> list[Stored]:
        """Every stored block whose chain runs through one of ``names`` (children, their children, ...)."""
        children: dict[str, list[Stored]] = {}
        for s in self.entries.values():
            if not s.is_first:
                children.setdefault(object_name(s.namespace, s.parent_key), []).append(s)
        out: list[Stored] = []
        todo, seen = sorted(names), set(names)
        while todo:
            for child in sorted(children.get(todo.pop(), []), key=lambda c: c.name):
                if child.name not in seen:
                    seen.add(child.name)
                    out.append(child)
                    todo.append(child.name)
        return out

    def chain(self, stored: Stored) -> tuple[Stored, ...] | None:
        """``stored``'s chain from block 0 to it, or ``None`` when a block of its prefix is not in the store."""
        out = [stored]
        while not out[-1].is_first:
            parent = self.entries.get(object_name(stored.namespace, out[-1].parent_key))
            if parent is None or len(out) > len(self.entries):
                return None
            out.append(parent)
        return tuple(reversed(out))


def read_stored_header(store: Store, stored: Stored, tenants: Mapping[str, Tenant]) -> SnapshotHeader:
    """The header of ``stored`` from the first tier that still holds it (checksummed and self-consistent).

    Raises:
        SnapshotError: no tier holds it any more, or its header is corrupt or undecryptable.
    """
    for i in stored.tiers:
        tier = store.tiers[i]
        src = tier.read(stored.name)
        if src is not None:
            return _header(tier, stored.name, src, _secret(tenants, stored.namespace))
    raise SnapshotError(f"{stored.name} is no longer in the store", location=stored.name)


def _secret(tenants: Mapping[str, Tenant], namespace: str) -> bytes | None:
    return tenants[namespace].encryption_key if namespace in tenants else None


def _sealed(src: object) -> bool:
    return isinstance(src, pa.Buffer) and is_sealed(memoryview(src))


def _header(tier: Tier, name: str, src: pa.Buffer | pa.NativeFile, secret: bytes | None) -> SnapshotHeader:
    location = tier.describe(name)
    header = read_header(plaintext(src, secret, name, location=location), location=location)
    header.check_consistent(location=location)  # a prefix's tokens are recomputed from: they must be the key's
    ns, key = parse_object_name(name)
    if header.key != key or header.tenant != ns:
        raise SnapshotMismatch(f"the file {name} holds {header.tenant}/{header.key}", location=location)
    return header


def catalogue(store: Store, *, namespace: str | None = None, tenants: Mapping[str, Tenant] = {}) -> Catalogue:
    """Read the header of every snapshot in ``store`` (of ``namespace`` only, when given) once.

    A copy that cannot be read (corrupt, removed meanwhile) is left to ``prefill store verify``
    and another tier's copy is tried; one sealed for a tenant whose key is not configured is
    counted in ``encrypted``.
    """
    out = Catalogue()
    seen: dict[str, list[int]] = {}
    found: dict[str, Stored] = {}  # headers themselves are not kept: a large store's token ids would not fit
    prefix = f"{namespace}/" if namespace else ""
    for i, tier in enumerate(store.tiers):
        for entry in list(tier.entries(prefix)):
            name = entry.name
            seen.setdefault(name, []).append(i)
            if name in found:
                continue
            ns, _ = parse_object_name(name)
            secret = _secret(tenants, ns)
            try:
                src = tier.read(name)
                if src is None:
                    continue  # removed meanwhile
                if secret is None and _sealed(src):
                    out.encrypted += 1  # cannot be judged without the tenant's key: skipped, as verify does
                    continue
                header = _header(tier, name, src, secret)
            except SnapshotError as exc:
                out.unreadable.append((tier.describe(name), f"{type(exc).__name__}: {exc}"))
                log.warning("audit: cannot read %s (%s); prefill store verify checks it", tier.describe(name), exc)
                continue
            found[name] = Stored(ns, header.key, header.parent_key, header.root_key, header.origin,
                                 header.model_fingerprint, header.adapter_hash, header.expires_at, ())
    out.entries = {name: replace(s, tiers=tuple(seen[name])) for name, s in found.items()}
    return out


@dataclass(frozen=True)
class Selection:
    """The snapshots to audit, in audit order, and how many of the rest were passed over, by why."""

    targets: tuple[Stored, ...]
    other_models: dict[str, int]  # model fingerprint -> snapshots of it (of the sources asked for)
    skipped: dict[str, int]  # adapter, expired, not_sampled


def select(cat: Catalogue, *, model_fingerprint: str, sources: Sequence[str] = SOURCE_ORDER,
           sample: int | None = None, now: float, rng: random.Random) -> Selection:
    """The snapshots of ``sources`` made by ``model_fingerprint`` (without an adapter) and not expired:
    the ``public`` namespace's first (every tenant loads them), then in :data:`SOURCE_ORDER` and random
    order within a source; the first ``sample`` of them (all for ``None``)."""
    others: dict[str, int] = {}
    skipped = {"adapter": 0, "expired": 0, "not_sampled": 0}
    by_source: dict[str, list[Stored]] = {s: [] for s in SOURCE_ORDER}
    for s in sorted(cat.entries.values(), key=lambda s: s.name):  # sorted: one seed, one order
        if s.origin not in sources:
            continue
        if s.model_fingerprint != model_fingerprint:
            others[s.model_fingerprint] = others.get(s.model_fingerprint, 0) + 1
        elif s.adapter_hash:
            skipped["adapter"] += 1  # KV of the model with a LoRA adapter: the audit loads none
        elif s.expires_at <= now:
            skipped["expired"] += 1  # no reader takes it any more; GC removes it
        else:
            by_source.setdefault(s.origin, []).append(s)
    ordered: list[Stored] = []
    for source in [*SOURCE_ORDER, *sorted(set(by_source) - set(SOURCE_ORDER))]:
        group = by_source.get(source, [])
        rng.shuffle(group)
        ordered += group
    # public snapshots first, whatever their source: every tenant loads them (a stable sort keeps the rest's order)
    ordered.sort(key=lambda s: s.namespace != PUBLIC)
    if sample is not None and len(ordered) > sample:
        skipped["not_sampled"] = len(ordered) - sample
        ordered = ordered[:sample]
    return Selection(tuple(ordered), others, skipped)


@dataclass
class AuditPath:
    """One forward: a chain from block 0 to its tip, and the indexes on it of the snapshots to judge."""

    chain: tuple[Stored, ...]
    targets: list[int]

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.chain]


def plan_paths(cat: Catalogue, targets: Sequence[Stored]) -> tuple[list[AuditPath], list[Stored]]:
    """Group ``targets`` (in audit order) by chain: each path is one forward, in the order of its first
    target, holding every target on it. Returns the paths, and the targets whose prefix is not stored
    (their KV cannot be recomputed: a block of the chain was evicted, expired or quarantined)."""
    paths: list[AuditPath] = []
    orphans: list[Stored] = []
    for t in targets:
        chain = cat.chain(t)
        if chain is None:
            orphans.append(t)
            continue
        keys = [s.key for s in chain]
        for p in paths:
            if t.key in p.keys:  # on a path already planned (an ancestor of its tip)
                p.targets.append(p.keys.index(t.key))
                break
            if keys[:len(p.chain)] == p.keys:  # the path's tip is an ancestor of t: go on to t
                p.chain = chain
                p.targets.append(len(chain) - 1)
                break
        else:
            paths.append(AuditPath(chain, [len(chain) - 1]))
    return paths, orphans
