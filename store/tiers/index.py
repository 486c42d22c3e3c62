"""The local tier's index: one SQLite table of sizes, expiry, last access and reservations.

Shared by every process using the same tier directory (WAL mode; writers serialise on
``BEGIN IMMEDIATE``). Readers never write to it on the hot path: they note accesses in
memory, and the notes are written in one transaction at most every ``flush_s``. The
index holds nothing the files do not also tell, so it can always be rebuilt
(:meth:`store.tiers.local.LocalTier.reconcile`).

Bookkeeping never fails a read: when the accesses cannot be written (the disk full, the
database busy past its timeout), they stay in memory for the next flush, the failure is
counted (:attr:`TierIndex.unwritten`) and logged once per episode. An index that cannot even
be opened (a full disk) leaves the tier readable; its writes raise :class:`store.errors.StoreFull`.
"""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

from store.errors import StoreError
from store.tiers.repair import FINITE, INTEGER, MAX_PID, MAX_SIZE, Repair, repair
from store.tiers.sqlite import LocalDB

log = logging.getLogger("kvwarm.store")

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
#: what every row must hold (:func:`store.tiers.repair.repair` drops the others at open): a
#: snapshot's object name (``<tenant>/<kk>/<key>.kvw``: the tier unlinks files by it, so
#: nothing that leads out of ``objects/``), a size, finite times, a state and a pid
_VALID = {"entries": " AND ".join([
    "typeof(name) = 'text' AND length(name) <= 256 AND name GLOB '[a-z0-9]*/[0-9a-f][0-9a-f]/[0-9a-f]*.kvw'",
    "length(name) - length(replace(name, '/', '')) = 2",
    INTEGER.format("size", 0, MAX_SIZE), FINITE.format("last_access"), FINITE.format("expires"),
    "state IN ('pending', 'ready')", INTEGER.format("pid", 0, MAX_PID),
])}


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (``False`` for anything that is not a
    pid: ``kill`` would take 0 and -1 for this process group and for every process)."""
    if type(pid) is not int or not 0 < pid <= MAX_PID:
        return False
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

    A damaged file is set aside and rows out of bounds are dropped before first use
    (:func:`store.tiers.repair.repair`; :attr:`repair` says what was done): the index is then
    :attr:`fresh`, and its owner rebuilds it from the files.
    """

    def __init__(self, path: Path, *, clock: Callable[[], float], flush_s: float) -> None:
        self.path = path
        self.clock = clock
        self.flush_s = flush_s
        self.repair: Repair | None = repair(path, _SCHEMA, _VALID, timeout_s=60)
        self.fresh = self.repair is not None or not path.exists() or path.stat().st_size == 0
        self._sqlite = LocalDB(path, _SCHEMA, synchronous="NORMAL", timeout_s=60)
        self._accesses: dict[str, float] = {}
        self._lock = threading.Lock()
        self._last_flush = clock()
        #: access flushes that could not be written (their accesses were kept for the next one)
        self.unwritten = 0
        self._failing = False
        try:
            self.db()
        except StoreError as exc:  # a full disk: the files can still be read; writes raise it again
            log.warning("the tier's index cannot be opened (%s); snapshots are served, writes wait for space", exc)

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
            self.try_flush()

    def try_flush(self) -> bool:
        """Write buffered accesses in a transaction of their own; ``False`` (counted, logged once
        until a flush works again, the accesses kept for the next try) when they cannot be written."""
        taken: dict[str, float] = {}
        try:
            with self.txn() as db:
                taken = self.flush(db)
        except (StoreError, sqlite3.Error) as exc:
            self._keep(taken)  # written, then the commit failed: they come back
            with self._lock:
                # the next try waits flush_s, and at least a second: reads do not retry a full disk each
                self._last_flush = self.clock() + max(0.0, 1.0 - self.flush_s)
                self.unwritten += 1
                first, self._failing = not self._failing, True
            if first:
                log.warning("access records of the local tier could not be written (%s); reads go on, "
                            "LRU order is kept in memory until they can be", exc)
            return False
        if self._failing:
            self._failing = False
            log.warning("access records of the local tier are written again")
        return True

    def flush(self, db: sqlite3.Connection) -> dict[str, float]:
        """Write buffered accesses inside the caller's transaction; returns them (name: time)."""
        with self._lock:
            accesses, self._accesses = self._accesses, {}
            self._last_flush = self.clock()
        if accesses:
            try:
                db.executemany(
                    "UPDATE entries SET last_access = MAX(last_access, ?) WHERE name = ?",
                    [(t, n) for n, t in accesses.items()],
                )
            except BaseException:
                self._keep(accesses)
                raise
        return accesses

    def _keep(self, accesses: dict[str, float]) -> None:
        """Put accesses that were not written back into the buffer."""
        with self._lock:
            for name, t in accesses.items():
                self._accesses[name] = max(t, self._accesses.get(name, t))

    def close(self) -> None:
        """Write buffered accesses (best effort: a full disk loses only LRU order) and close this
        thread's connection."""
        self.try_flush()
        self._sqlite.close()
