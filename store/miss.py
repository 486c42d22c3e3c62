"""Why a read or a lookup found nothing: :class:`MissReason`, and the reason behind each store error.

The store's read path (:meth:`store.tiers.store.Store.read`) answers a miss with one of
these; the loader counts lookups under them (``kvwarm_loader_misses_total{reason}``).
The values are the Prometheus label values dashboards select on: they never change.
"""
from __future__ import annotations

from enum import Enum

from store.errors import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotMismatch,
    StoreRecordInvalid,
    StoreUnavailable,
    TenantAccessDenied,
    UnknownFormatVersion,
)


class MissReason(str, Enum):
    """Why a lookup (or part of one) was not served. ``str(reason)`` is its label value."""

    ABSENT = "absent"  # no tier holds the first block
    SHORT_PROMPT = "short_prompt"  # fewer tokens than one block plus the one a model must compute
    FETCH_SCHEDULED = "fetch_scheduled"  # not in NVMe; S3 is being asked in the background (default mode)
    FETCH_TIMEOUT = "fetch_timeout"  # not in NVMe; the synchronous S3 fetch did not finish in time
    STORE_UNAVAILABLE = "store_unavailable"  # S3 unreachable (or in its back-off window after a failure)
    CORRUPT = "corrupt"  # damaged file: quarantined
    MISMATCH = "mismatch"  # intact file that is not what was asked (wrong model, tokens...): quarantined
    UNKNOWN_VERSION = "unknown_version"  # written by a snapshot format this reader does not know
    UNDECRYPTABLE = "undecryptable"  # sealed with a key this node lacks: refused, never quarantined
    EXPIRED = "expired"  # past its TTL
    TENANT_REFUSED = "tenant_refused"  # a namespace owned by another tenant's secret
    POOL_FULL = "pool_full"  # the node's pool budget is held by pinned snapshots
    MAX_SHARED_INSTANCES = "max_shared_instances"  # this process could not attach to the node's pool
    BAD_RECORD = "bad_record"  # a store metadata file (owner record, index) failed validation: fixed by an operator
    ERROR = "error"  # any other StoreError or OSError (logged with its traceback)

    def __str__(self) -> str:
        return self.value


def reason_of(exc: BaseException) -> MissReason:
    """The miss reason a store error stands for (``ERROR`` for anything unforeseen)."""
    if isinstance(exc, SnapshotMismatch):
        return MissReason.MISMATCH
    if isinstance(exc, SnapshotCorrupt):
        return MissReason.CORRUPT
    if isinstance(exc, UnknownFormatVersion):
        return MissReason.UNKNOWN_VERSION
    if isinstance(exc, SnapshotError):  # sound but sealed for a key this node lacks
        return MissReason.UNDECRYPTABLE
    if isinstance(exc, TenantAccessDenied):
        return MissReason.TENANT_REFUSED
    if isinstance(exc, StoreUnavailable):
        return MissReason.STORE_UNAVAILABLE
    if isinstance(exc, StoreRecordInvalid):
        return MissReason.BAD_RECORD
    return MissReason.ERROR
