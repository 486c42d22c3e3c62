"""The errors a write-back ring raises on purpose (all :class:`store.errors.StoreError`)."""
from __future__ import annotations

from store.errors import BadInputError, OperationalError, StoreError


class RingError(StoreError):
    """Base class of the write-back ring's errors."""


class RingFormatMismatch(RingError, OperationalError):
    """The file is not a kvwarm ring, or a ring of another format version: nothing in it is read.

    Attributes:
        found: the version the file says (``None`` when it is no kvwarm ring at all).
        expected: the version this kvwarm reads.
    """

    def __init__(self, message: str, *, path: str, found: int | None, expected: int) -> None:
        super().__init__(f"{message} ({path})")
        self.path = path
        self.found = found
        self.expected = expected


class RingBusy(RingError, OperationalError):
    """Another live process already holds this end of the ring (one producer, one consumer)."""


class RecordTooLarge(RingError, BadInputError):
    """A record can never fit the ring (more bytes than its arena, more parts or longer names
    than a descriptor holds): make the ring larger, or split the record."""
