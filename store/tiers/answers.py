"""What the tiered store's calls answer (:mod:`store.tiers.store`): a probe's count, a read's
snapshot or miss, a listing's entries. Frozen values, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from store.errors import StoreError
from store.format.snapshot import Snapshot
from store.miss import MissReason


@dataclass(frozen=True)
class Probe:
    """Answer of :meth:`Store.probe`: how many leading blocks exist, in which tier, and
    which tiers could not be asked (unreachable: counted, and the others answered)."""

    count: int
    tier: str | None
    unavailable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Read:
    """Answer of :meth:`Store.read`: the snapshot of a block, or why there is none."""

    snapshot: Snapshot | None
    miss: MissReason | None = None  # None on a hit
    tier: str | None = None  # kind of the tier that held it
    size: int = 0  # bytes of the object it was read from (the file mapped, on a mappable tier)
    error: StoreError | None = None  # what made it a miss, when something failed (see Store.get)
    #: with ``read_through=False``: the bytes read from a remote tier, not yet in the local one
    #: (:meth:`Store.land` writes them there)
    source: "pa.Buffer | pa.NativeFile | None" = None


@dataclass(frozen=True)
class Listed:
    """One snapshot in a tenant's listing, merged over tiers."""

    key: str
    size: int
    tiers: tuple[str, ...]
