"""The interface every storage tier implements, and naming of objects within a tier.

Tiers store opaque snapshot files under names ``<tenant>/<key[:2]>/<key>.kvw``. They
know nothing of headers or tenants' secrets: the :class:`store.tiers.store.Store` checks
those. Every tier has the same small surface (after SGLang's HiCache storage):
read, write, exists, a batch probe answering "how many leading names exist", delete,
list, quarantine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Sequence

import pyarrow as pa

from store.format.encode import EncodedSnapshot
from store.identity.keys import check_key
from store.identity.tenant import check_tenant_name

SUFFIX = ".kvw"


def object_name(tenant: str, key: str) -> str:
    """The name of a snapshot inside any tier."""
    return f"{check_tenant_name(tenant)}/{key[:2]}/{check_key(key)}{SUFFIX}"


def parse_object_name(name: str) -> tuple[str, str]:
    """``(tenant, key)`` from an object name; raises ``ValueError`` for anything else."""
    parts = name.split("/")
    if len(parts) != 3 or not parts[2].endswith(SUFFIX):
        raise ValueError(f"not a snapshot object name: {name!r}")
    tenant, key = parts[0], parts[2][: -len(SUFFIX)]
    check_tenant_name(tenant)
    check_key(key)
    if parts[1] != key[:2]:
        raise ValueError(f"not a snapshot object name: {name!r}")
    return tenant, key


@dataclass(frozen=True)
class Entry:
    """One stored object as a listing sees it."""

    name: str
    size: int
    mtime: float


class Tier(ABC):
    """A place snapshots are kept. Reads of a missing object return ``None``;
    an unreachable tier raises :class:`store.errors.StoreUnavailable`."""

    #: short name for metrics and messages ("nvme", "s3")
    kind: str = "tier"
    url: str = ""

    @abstractmethod
    def read(self, name: str) -> pa.Buffer | None:
        """The object's bytes: a buffer over a read-only memory map (local) or in memory (remote)."""

    @abstractmethod
    def write(self, name: str, data: EncodedSnapshot | bytes | pa.Buffer, *, expires_at: float) -> bool:
        """Store atomically. Returns ``False`` when the tier knows the object already
        exists (or is being written by another live process), ``True`` when this call
        wrote it. Tiers without a cheap existence check (S3) may replace the object with
        the same immutable content and return ``True``; callers check :meth:`exists`
        first when a write is expensive."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether the object exists (no validation of its contents)."""

    @abstractmethod
    def probe(self, names: Sequence[str]) -> int:
        """How many leading ``names`` exist, in one round trip (not one per name)."""

    @abstractmethod
    def delete(self, name: str) -> bool:
        """Remove the object; ``False`` if it was not there."""

    @abstractmethod
    def entries(self, prefix: str = "") -> Iterator[Entry]:
        """Snapshot objects whose names start with ``prefix`` (e.g. ``"acme/"``)."""

    @abstractmethod
    def quarantine(self, name: str, reason: str) -> str | None:
        """Move a bad object aside for inspection (never delete it); returns where it went."""

    @abstractmethod
    def get_meta(self, name: str) -> bytes | None:
        """A small object from the tier's metadata area (namespace owners, run results)."""

    @abstractmethod
    def put_meta(self, name: str, data: bytes) -> None:
        """Write a small metadata object atomically (it is not counted against caps)."""

    def quarantined(self) -> list[Entry]:
        """Objects in quarantine."""
        return []

    def touch(self, name: str) -> None:
        """Record an access for LRU (tiers without eviction ignore it)."""

    def describe(self, name: str) -> str:
        """Where an object lives, for messages."""
        return f"{self.url.rstrip('/')}/{name}"

    def close(self) -> None:
        """Release resources (flush pending access records)."""
