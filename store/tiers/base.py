"""The interface every storage tier implements, and naming of objects within a tier.

Tiers store opaque snapshot files under names ``<tenant>/<key[:2]>/<key>.kvw``. They
know nothing of headers or tenants' secrets: the :class:`store.tiers.store.Store` checks
those. Every tier has the same small surface (after SGLang's HiCache storage):
read, write, exists, a batch probe answering "how many leading names exist", delete,
list, quarantine, and a small metadata area (get, put, list); the same constructor, :meth:`Tier.from_url`; and says what else it
can do by its capabilities (``remote``, ``stores_encoded``, ``mappable``, ``capped``),
never by its class. A new tier is one module and one line in
:data:`store.tiers.registry.TIERS`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Iterator, Sequence

import pyarrow as pa

from store.config import StoreConfig
from store.errors import StoreRecordInvalid
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


@dataclass
class Housekeeping:
    """What a capped tier's :meth:`Tier.housekeep` did."""

    temp_removed: int = 0  # temp files of dead writers
    expired_removed: int = 0  # snapshots past their recorded expiry
    evicted: int = 0  # snapshots evicted (LRU) to get under the cap
    index_fixes: dict[str, int] = field(default_factory=dict)  # drift between the tier's index and its objects


class Tier(ABC):
    """A place snapshots are kept. Reads of a missing object return ``None``;
    an unreachable tier raises :class:`store.errors.StoreUnavailable`.

    Capabilities (class attributes; the store, the loader and GC go by these):

    - ``remote``: reached over a network, so it may be slow or down. The serving hot
      path never asks it (``Store.probe/read(..., local_only=True)``), a hit in it is
      copied into the first tier when that one is not remote (read-through), and a
      store URL without a local tier gets the default local directory first.
    - ``stores_encoded``: :meth:`write` takes the encoded snapshot as it is (never
      sealed: its files stay mappable) and itself skips an object that exists,
      returning ``False``. Other tiers get the snapshot's bytes, sealed for a tenant
      with an encryption key, and only after :meth:`exists` said it is not there.
    - ``mappable``: :meth:`path` names the local file of an object, which the loader
      maps (and shares through the node's pool); its first tier must be mappable.
    - ``capped``: a byte cap with LRU eviction, and each object's expiry recorded:
      :meth:`housekeep` removes what has expired. GC ages other tiers' objects by
      their modification time instead.
    """

    #: the URL scheme it serves (``file`` for ``file://...``); its line in the registry
    scheme: ClassVar[str] = ""
    remote: ClassVar[bool] = True
    stores_encoded: ClassVar[bool] = False
    mappable: ClassVar[bool] = False
    capped: ClassVar[bool] = False
    #: short name for metrics and messages ("nvme", "s3")
    kind: str = "tier"
    url: str = ""

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, settings: StoreConfig, *, create_bucket: bool = False) -> "Tier":
        """The tier a store URL's part names (``<scheme>://...``), with the config's ``store`` section.

        Raises:
            ConfigError: a malformed URL or setting (the message names it).
        """

    @abstractmethod
    def read(self, name: str, *, readahead: bool = False) -> pa.Buffer | None:
        """The object's bytes: a buffer over a read-only memory map (mappable) or in memory.

        ``readahead``: the caller will use the whole object at once; a tier that maps
        files may ask the kernel to read it ahead."""

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

    def get_meta_capped(self, name: str, max_bytes: int) -> bytes | None:
        """:meth:`get_meta`, for a file whose size a reader bounds (fleet records): an object over
        ``max_bytes`` is refused without being read whole where the tier can tell its size first.

        Raises:
            StoreRecordInvalid: the object holds more than ``max_bytes`` bytes.
        """
        data = self.get_meta(name)
        if data is not None and len(data) > max_bytes:
            raise meta_too_large(f"{self.kind} tier metadata {name}", len(data), max_bytes)
        return data

    @abstractmethod
    def put_meta(self, name: str, data: bytes) -> None:
        """Write a small metadata object atomically (it is not counted against caps)."""

    @abstractmethod
    def list_meta(self, prefix: str) -> list[str]:
        """Names of the metadata objects whose names start with ``prefix`` (``"fleet/acme/"``),
        sorted; writes in progress are not listed. Raises :class:`store.errors.StoreUnavailable`
        when the tier cannot be reached."""

    def quarantined(self) -> list[Entry]:
        """Objects in quarantine."""
        return []

    def touch(self, name: str) -> None:
        """Record an access for LRU (tiers without eviction ignore it). Never raises for a record
        that cannot be written (a full disk): it is kept, counted and written later."""

    def bookkeeping_unwritten(self) -> int:
        """How often this process's access records could not be written (a full disk); reads went on."""
        return 0

    def path(self, name: str) -> Path:
        """The local file holding an object (``mappable`` tiers only)."""
        raise NotImplementedError(f"the {self.kind} tier holds no local files to map")

    def housekeep(self, now: float) -> Housekeeping:
        """Remove temp files of dead writers, fix index drift, remove what expired by
        ``now`` and get under the cap (``capped`` tiers only)."""
        raise NotImplementedError(f"the {self.kind} tier keeps no expiry or cap of its own")

    def describe(self, name: str) -> str:
        """Where an object lives, for messages."""
        return f"{self.url.rstrip('/')}/{name}"

    def open_client(self) -> None:
        """Build the client a remote tier reaches its service with, without a request (local
        tiers: nothing). Made on first use otherwise; building it is tens of ms of Python
        (botocore's models), which a process pays where it chooses: before it serves."""

    def call_on_io_thread(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` once on the thread this tier's requests run on (a remote tier's event loop),
        without waiting for it: ``False`` where the tier has no such thread (local tiers run on
        the caller's). The serving side lowers that thread's priority with it
        (:func:`store.serving.priority.lower_this_thread`)."""
        return False

    def close(self) -> None:
        """Release resources (flush pending access records)."""


def meta_too_large(where: str, size: int | str, max_bytes: int) -> StoreRecordInvalid:
    """The error of a metadata object over its reader's size cap (``size``: bytes, or ``"over N"``)."""
    return StoreRecordInvalid(f"the file holds {size} bytes, more than the {max_bytes} its reader accepts: "
                              "remove or repair it", location=where)
