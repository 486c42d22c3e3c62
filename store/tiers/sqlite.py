"""A SQLite database shared by processes on one host: one connection per thread, WAL, ``BEGIN IMMEDIATE``.

What the local tier's index (:mod:`store.tiers.index`) and the node's snapshot pool
(:mod:`store.serving.pool`) both need: sqlite3 connections are not shared across threads, so
each thread opens its own (autocommit, WAL, the schema applied); writers serialise on
``BEGIN IMMEDIATE`` and wait for each other up to ``timeout_s``.
"""
from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal

Synchronous = Literal["OFF", "NORMAL", "FULL", "EXTRA"]
_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


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
    """

    def __init__(self, path: Path, schema: str, *, synchronous: Synchronous, timeout_s: float = 60) -> None:
        if synchronous not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {', '.join(_SYNCHRONOUS)}, got {synchronous!r}")
        self.path = path
        self.schema = schema
        self.synchronous = synchronous
        self.timeout_s = timeout_s
        self._local = threading.local()

    def db(self) -> sqlite3.Connection:
        """This thread's connection (sqlite3 connections are not shared across threads)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.synchronous}")
            db.executescript(self.schema)
            self._local.db = db
        return db

    @contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        """A write transaction; other writers wait (up to ``timeout_s``) until it commits."""
        db = self.db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        """Close this thread's connection (a later :meth:`db` opens a new one)."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
