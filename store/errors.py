"""Typed errors of the store.

A cache *miss* is never an exception (readers return ``None``). These are raised for
things a caller must tell apart from a miss: a corrupt or mismatched snapshot, a
refused cross-tenant access, a tier that cannot be reached, bad configuration.
The serving-side loader catches :class:`StoreError` and turns it into a counted miss.
"""
from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class ConfigError(StoreError, ValueError):
    """A configuration value is invalid. The message names the key, the value and what is allowed."""


class SnapshotError(StoreError):
    """A snapshot file cannot be trusted. Carries the file's location for the operator."""

    def __init__(self, message: str, *, location: str = "") -> None:
        super().__init__(f"{message} ({location})" if location else message)
        self.location = location


class SnapshotCorrupt(SnapshotError):
    """The bytes are damaged: bad magic, truncated, checksum mismatch, unparsable header."""


class UnknownFormatVersion(SnapshotError):
    """The snapshot was written by a format version this reader does not know."""


class SnapshotMismatch(SnapshotError):
    """The snapshot is intact but is not what was asked for (key, tokens, model, tenant...)."""


class TenantAccessDenied(StoreError):
    """A tenant tried to read, list or probe a namespace that is not its own (counted)."""


class StoreUnavailable(StoreError):
    """A tier could not be reached or did not answer within its timeout."""


class StoreFull(StoreError):
    """A write cannot fit under the tier's byte cap, even after eviction."""
