"""The errors kvwarm raises on purpose, and the two kinds a user must tell apart.

Every project error derives from :class:`KvwarmError`, and each concrete one from
exactly one of its two kinds:

- :class:`BadInputError` (also a ``ValueError``): an argument, a config value or an
  input file is wrong, and the user must fix it. A CLI exits 2 with the message.
- :class:`OperationalError`: the input was fine but the operation could not be done
  (a tier unreachable, a corrupt snapshot, a refused access, a deadline passed). A CLI
  exits 1 with the error's name and message.

Anything else escaping a CLI is a bug and is left to show its traceback. Family bases
(:class:`StoreError` here, ``prefill.runner.PrefillError``) belong to neither kind;
their members each pick one. ``store`` is the package every other may import, so the
bases live here.

A cache *miss* is never an exception (readers return ``None``). The store's errors are
raised for things a caller must tell apart from a miss: a corrupt or mismatched
snapshot, a refused cross-tenant access, a tier that cannot be reached, bad
configuration. The serving-side loader catches :class:`StoreError` and turns it into a
counted miss.
"""
from __future__ import annotations


class KvwarmError(Exception):
    """Base class of every error kvwarm raises on purpose; its message says what to do next."""


class BadInputError(KvwarmError, ValueError):
    """An argument, config value or input file is wrong: the user must fix it (a CLI exits 2)."""


class OperationalError(KvwarmError):
    """The operation could not be done with good input: a tier down, a corrupt snapshot, a
    refused access, a deadline passed (a CLI exits 1)."""


class StoreError(KvwarmError):
    """Base class of every error the store raises on purpose."""


class ConfigError(StoreError, BadInputError):
    """A configuration value is invalid. The message names the key, the value and what is allowed."""


class SnapshotError(StoreError, OperationalError):
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


class StoreRecordInvalid(StoreError, OperationalError):
    """A file kvwarm reads from a store's metadata (a namespace's owner record, the index, a fleet
    record) is damaged or holds values out of bounds. Readers count it as a miss and go on; writers
    that depend on it are refused until an operator repairs it (``prefill store verify`` names it)."""

    def __init__(self, message: str, *, location: str = "") -> None:
        super().__init__(f"{message} ({location})" if location else message)
        self.location = location


class TenantAccessDenied(StoreError, OperationalError):
    """A tenant tried to read, list or probe a namespace that is not its own (counted)."""


class StoreUnavailable(StoreError, OperationalError):
    """A tier could not be reached or did not answer within its timeout."""


class StoreFull(StoreError, OperationalError):
    """A write cannot fit under the tier's byte cap, even after eviction."""


class NodeUnavailable(StoreError, OperationalError):
    """No kvwarm node process answers at its socket (none runs, it died, or it did not start in time)."""


class NodeRefused(StoreError, BadInputError):
    """The kvwarm node process at the socket runs another kvwarm version or another store configuration.
    The message names the version or the settings that differ."""
