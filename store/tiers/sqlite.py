"""A SQLite database shared by processes on one host: one connection per thread, WAL, ``BEGIN IMMEDIATE``.

What the local tier's index (:mod:`store.tiers.index`) and the node's snapshot pool
(:mod:`store.serving.pool`) both need: sqlite3 connections are not shared across threads, so
each thread opens its own (autocommit, WAL, the schema applied); writers serialise on
``BEGIN IMMEDIATE`` and wait for each other up to ``timeout_s``.

A full file system is an ordinary condition: SQLite's "database or disk is full" (and the
I/O error it gives when it cannot even size the WAL's shared memory file on a full disk) is
raised as :class:`store.errors.StoreFull`, naming the database, from opening a connection, from
a transaction's statements and from its commit. :meth:`LocalDB.private` is a database in
this process's memory, for state that can live without sharing when its file cannot be written.
"""
from __future__ import annotations

import errno
import sqlite3
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import ContextManager, Iterator, Literal

from store.errors import StoreFull

Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]
_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")
_SQLITE_FULL = 13
#: SQLITE_IOERR_SHMSIZE: the WAL index (``-shm``) could not be grown, which on a full disk
#: is what opening any WAL database gives (even to read it)
_SQLITE_IOERR_SHMSIZE = 4874
#: what the operating system says when a write cannot fit: the disk, or the user's quota
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_space_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a write did not fit: ``ENOSPC``/``EDQUOT``, or SQLite's "database or
    disk is full" (or its shared-memory sizing error, which a full disk gives)."""
    if isinstance(exc, OSError):
        return exc.errno in SPACE_ERRNOS
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == _SQLITE_FULL or code == _SQLITE_IOERR_SHMSIZE or (
            code is None and "database or disk is full" in str(exc))
    return False


def full_disk(where: Path | str, exc: BaseException, what: str) -> StoreFull:
    """The :class:`StoreFull` for a write to ``where`` that did not fit (``exc``), saying what to do."""
    return StoreFull(f"no space left to {what} on the file system holding {where} ({exc}); free space there, "
                     "or lower store.nvme_cap below what it can hold so that eviction makes room")


class LocalDB:
    """A database file with its schema, opened once per thread.

    Args:
        path: the database file (created with ``schema`` if missing).
        schema: SQL run on every new connection (``CREATE ... IF NOT EXISTS``).
        synchronous: ``PRAGMA synchronous``: ``NORMAL`` for state that must survive a
            power loss, ``OFF`` for state rebuilt from nothing after a reboot.
        timeout_s: how long a writer waits for another's transaction to commit.

    Raises:
        ValueError: ``synchronous`` is not one of OFF, NORMAL, FULL, EXTRA.
        StoreFull: (from :meth:`db` and :meth:`txn`) the file system holding ``path`` is full.
    """

    def __init__(self, path: Path, schema: str, *, synchronous: Synchronous, timeout_s: float = 60) -> None:
        if synchronous not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {', '.join(_SYNCHRONOUS)}, got {synchronous!r}")
        self.path = path
        self.schema = schema
        self.synchronous = synchronous
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._shared: sqlite3.Connection | None = None  # a private database's one connection
        self._lock: threading.RLock | None = None

    @classmethod
    def private(cls, schema: str, *, name: str = "private") -> "LocalDB":
        """A database in this process's memory, with ``schema``: one connection that every thread
        uses under a lock (:meth:`txn` and :meth:`reading`); nothing is shared with other processes."""
        db = cls(Path(f":memory:{name}"), schema, synchronous="OFF")
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        conn.executescript(schema)
        db._shared, db._lock = conn, threading.RLock()
        return db

    @property
    def is_private(self) -> bool:
        """Whether this database lives in this process's memory (:meth:`private`)."""
        return self._shared is not None

    def db(self) -> sqlite3.Connection:
        """This thread's connection (sqlite3 connections are not shared across threads); a private
        database's one connection (use it inside :meth:`reading` or :meth:`txn`)."""
        if self._shared is not None:
            return self._shared
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(f"PRAGMA synchronous={self.synchronous}")
                db.executescript(self.schema)
            except sqlite3.Error as exc:
                db.close()  # the next call tries again: the disk may have room by then
                if is_space_error(exc):
                    raise full_disk(self.path, exc, "open the database") from exc
                raise
            self._local.db = db
        return db

    def reading(self) -> ContextManager[None]:
        """Held around reads outside :meth:`txn`: a private database's lock (its one connection is
        shared by threads), nothing for a file."""
        return self._lock if self._lock is not None else nullcontext()

    @contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        """A write transaction; other writers wait (up to ``timeout_s``) until it commits.

        Raises:
            StoreFull: the transaction could not be written for lack of space (rolled back).
        """
        with self.reading():
            db = self.db()
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    if db.in_transaction:  # SQLite rolls back by itself after some errors (a full disk)
                        db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if is_space_error(exc):
                    raise full_disk(self.path, exc, "write the database") from exc
                raise

    def close(self) -> None:
        """Close this thread's connection (a later :meth:`db` opens a new one); a private
        database is closed for good."""
        if self._shared is not None:
            self._shared.close()
            return
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
