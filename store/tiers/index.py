"""The local tier's index: one SQLite table of sizes, expiry, last access and reservations.

Shared by every process using the same tier directory (WAL mode; writers serialise on
``BEGIN IMMEDIATE``). Readers never write to it on the hot path: they note accesses in
memory, and the notes are written in one transaction at most every ``flush_s``. The
index holds nothing the files do not also tell, so it can always be rebuilt
(:meth:`store.tiers.local.LocalTier.reconcile`).
"""
from __future__ import annotations

import errno
import os
import sqlite3
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

from store.tiers.sqlite import LocalDB

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    name TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    last_access REAL NOT NULL,
    expires REAL NOT NULL,
    state TEXT NOT NULL,          -- 'pending' (reserved, being written) or 'ready'
    pid INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_lru ON entries(state, last_access);
"""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


class TierIndex:
    """SQLite index at ``path`` with a buffer of accesses not yet written.

    Args:
        path: the database file (created with its schema if missing).
        clock: time source.
        flush_s: write buffered accesses at most this often.
    """

    def __init__(self, path: Path, *, clock: Callable[[], float], flush_s: float) -> None:
        self.path = path
        self.clock = clock
        self.flush_s = flush_s
        self.fresh = not path.exists()
        self._sqlite = LocalDB(path, _SCHEMA, synchronous="NORMAL", timeout_s=60)
        self._accesses: dict[str, float] = {}
        self._lock = threading.Lock()
        self._last_flush = clock()
        self.db()

    def db(self) -> sqlite3.Connection:
        """This thread's connection (sqlite3 connections are not shared across threads)."""
        return self._sqlite.db()

    def txn(self) -> AbstractContextManager[sqlite3.Connection]:
        """A write transaction; other writers wait (up to 60 s) until it commits."""
        return self._sqlite.txn()

    def usage(self) -> int:
        """Bytes reserved: ready snapshots plus writes in flight."""
        return int(self.db().execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0])

    def count(self) -> int:
        """Snapshots in the index (ready ones and writes in flight)."""
        return int(self.db().execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def note_access(self, name: str) -> None:
        """Record an access in memory; write the buffer if ``flush_s`` has passed."""
        now = self.clock()
        with self._lock:
            self._accesses[name] = now
            due = now - self._last_flush >= self.flush_s
        if due:
            with self.txn() as db:
                self.flush(db)

    def flush(self, db: sqlite3.Connection) -> None:
        """Write buffered accesses inside the caller's transaction."""
        with self._lock:
            accesses, self._accesses = self._accesses, {}
            self._last_flush = self.clock()
        if accesses:
            db.executemany(
                "UPDATE entries SET last_access = MAX(last_access, ?) WHERE name = ?",
                [(t, n) for n, t in accesses.items()],
            )

    def close(self) -> None:
        """Write buffered accesses and close this thread's connection."""
        with self.txn() as db:
            self.flush(db)
        self._sqlite.close()
