"""The upload backlog: snapshots on the node tier (NVMe) that are not yet in the remote tiers (S3).

Write-back writes each block to NVMe and enqueues it here; the uploads
(:class:`store.engines.vllm.uploads.Uploads`) drain the backlog as the link allows, reading
each object back from NVMe, and a row goes only when its object is in S3 or can never be
(evicted from NVMe, expired, corrupt, refused too often: each counted by its owner). So a block
on NVMe but not in S3 is never forgotten: it waits here, across restarts of the process, and a
writer that starts drains what an earlier one left.

One SQLite file in the NVMe tier's metadata area (``meta/backlog.sqlite``, WAL, ``synchronous =
NORMAL``: a committed row survives the process being killed; a power loss may lose the last
few), shared by every process of the node that writes to the tier (:class:`store.tiers.sqlite.LocalDB`).
One row per object name: the tenant whose credentials upload it, its size, when it was
enqueued, its rank (the value :mod:`store.serving.upload_rank` gives it: highest first, then
the oldest), failed attempts and when it may be tried again, and the pid of the process
uploading it now (a claim; a dead process's claims are released).

Damage is ordinary (:func:`store.tiers.repair.repair`): a file SQLite cannot read is set aside
and a new one started, rows out of bounds are dropped, and :attr:`UploadBacklog.damaged` says
so: the owner then enqueues the tier's objects again (:meth:`UploadBacklog.rescan`), and those
S3 already holds are found there and skipped. A full disk is ordinary too: a backlog that
cannot be opened lives in this process's memory (:attr:`UploadBacklog.persistent` is false), and
a row that cannot be written raises :class:`store.errors.StoreFull`.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping

from store.errors import StoreError, StoreFull
from store.tiers.base import Entry, parse_object_name
from store.tiers.index import pid_alive
from store.tiers.metadir import make_dirs
from store.tiers.repair import FINITE, INTEGER, MAX_PID, MAX_SIZE, Repair, repair
from store.tiers.sqlite import LocalDB

log = logging.getLogger("kvwarm.store")

#: the backlog's file in a local tier's metadata area
BACKLOG_FILE = "backlog.sqlite"
#: the most failed attempts a row may record (far beyond any owner's limit)
MAX_ATTEMPTS_RECORDED = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS backlog (
    name TEXT PRIMARY KEY,        -- the object's name in every tier: <namespace>/<kk>/<key>.kvw
    tenant TEXT NOT NULL,         -- whose credentials upload it
    size INTEGER NOT NULL,        -- bytes on NVMe
    enqueued REAL NOT NULL,       -- when it was enqueued (wall clock)
    rank REAL NOT NULL,           -- its value in the drain order: highest first (0: unranked, by age)
    attempts INTEGER NOT NULL,    -- failed uploads so far
    not_before REAL NOT NULL,     -- not tried again before this time (a failed upload's back-off)
    pid INTEGER NOT NULL          -- the process uploading it now (0: none)
);
-- the unclaimed rows (pid 0) in drain order: a claim walks it from the start
CREATE INDEX IF NOT EXISTS backlog_order ON backlog(pid, rank DESC, enqueued, name);
"""
#: what every row must hold (:func:`store.tiers.repair.repair` drops the others at open): a snapshot's
#: object name (nothing that leads out of ``objects/``), a tenant name, and numbers within bounds
_VALID = {"backlog": " AND ".join([
    "typeof(name) = 'text' AND length(name) <= 256 AND name GLOB '[a-z0-9]*/[0-9a-f][0-9a-f]/[0-9a-f]*.kvw'",
    "length(name) - length(replace(name, '/', '')) = 2",
    "typeof(tenant) = 'text' AND length(tenant) BETWEEN 1 AND 63 AND tenant GLOB '[a-z0-9]*'",
    "NOT tenant GLOB '*[^a-z0-9_.-]*'",
    INTEGER.format("size", 0, MAX_SIZE), FINITE.format("enqueued"), FINITE.format("not_before"),
    "(typeof(rank) IN ('integer', 'real') AND rank BETWEEN 0 AND 1)",
    INTEGER.format("attempts", 0, MAX_ATTEMPTS_RECORDED), INTEGER.format("pid", 0, MAX_PID),
])}
_ORDER = "ORDER BY rank DESC, enqueued, name"  # store.serving.upload_rank.drain_key
_COLUMNS = "name, tenant, size, enqueued, rank, attempts"


@dataclass(frozen=True)
class Pending:
    """One object waiting for its upload.

    Attributes:
        name: its object name (``<namespace>/<kk>/<key>.kvw``).
        tenant: whose credentials upload it.
        size: its bytes on NVMe.
        enqueued: when it was enqueued (wall clock).
        rank: its value in the drain order (0: unranked).
        attempts: its failed uploads so far.
    """

    name: str
    tenant: str
    size: int
    enqueued: float
    rank: float
    attempts: int


class UploadBacklog:
    """The backlog at ``path`` (see the module docstring).

    Args:
        path: the database file (created with its schema if missing); ``None``: in this
            process's memory (a node tier without a directory of its own).
        clock: wall time (enqueue times, back-off).
        timeout_s: how long a writer waits for another process's transaction.

    At open, rows that a dead process had claimed (or a process that had this pid before) are
    released: :attr:`resumed` counts the rows found waiting.
    """

    def __init__(self, path: Path | None, *, clock: Callable[[], float] = time.time,
                 timeout_s: float = 60.0) -> None:
        self.path = path
        self.clock = clock
        self.pid = os.getpid()
        #: what was wrong with the file at open (``None``: sound, new, or no file)
        self.repair: Repair | None = None if path is None else repair(path, _SCHEMA, _VALID, timeout_s=timeout_s)
        #: rows may be missing (the file was set aside, or rows dropped): the owner should :meth:`rescan`
        self.damaged = self.repair is not None
        #: whether rows survive this process (``False``: no file, or it could not be opened for lack of space)
        self.persistent = path is not None
        if path is None:
            self._sqlite = LocalDB.private(_SCHEMA, name="backlog")
        else:
            self._sqlite = LocalDB(path, _SCHEMA, synchronous="NORMAL", timeout_s=timeout_s)
            try:
                make_dirs(path.parent)
                self._sqlite.db()
            except (StoreFull, sqlite3.Error, OSError) as exc:  # a full disk, no permission: write-back goes on
                log.error("the upload backlog %s cannot be opened (%s); it lives in this process's memory until "
                          "restart: free space on that disk (or make it writable) so that a restart keeps it",
                          path, exc)
                self._sqlite = LocalDB.private(_SCHEMA, name="backlog")
                self.persistent = False
        #: claims released at open (a dead process's, or an earlier process's under this pid)
        self.released = 0
        #: rows found waiting at open (an earlier process's, or another's on this node)
        self.resumed = 0
        try:
            self.released = self.release_dead(own=True)
            self.resumed = self.count()
        except (StoreError, sqlite3.Error) as exc:  # locked past its timeout, the disk full: a later sweep does it
            log.warning("the upload backlog %s could not be read at open (%s); its rows wait for a later look",
                        path, exc)

    @classmethod
    def of_tier(cls, root: Path, *, clock: Callable[[], float] = time.time) -> "UploadBacklog":
        """The backlog of the local tier at ``root`` (in its metadata area)."""
        return cls(Path(root) / "meta" / BACKLOG_FILE, clock=clock)

    # -- writes --------------------------------------------------------------
    def add(self, name: str, tenant: str, size: int, *, rank: float = 0.0, enqueued: float | None = None) -> bool:
        """Enqueue one object; ``False`` when it waits already (its row is left as it is).

        Raises:
            ValueError: ``name`` is not an object name.
            StoreFull: the row cannot be written for lack of space.
        """
        parse_object_name(name)
        t = self.clock() if enqueued is None else enqueued
        with self._sqlite.txn() as db:
            cur = db.execute("INSERT OR IGNORE INTO backlog VALUES (?, ?, ?, ?, ?, 0, 0, 0)",
                             (name, tenant, int(size), float(t), float(rank)))
            return cur.rowcount == 1

    def rescan(self, entries: Iterable[Entry], tenant_of: Callable[[str], str | None]) -> int:
        """Enqueue the tier's objects (its listing), each at its file's time and under
        ``tenant_of(name)`` (``None``: left out); how many were not waiting already.

        Raises:
            StoreFull: the rows cannot be written for lack of space.
        """
        rows = []
        for e in entries:
            try:
                parse_object_name(e.name)
            except ValueError:
                continue
            tenant = tenant_of(e.name)
            if tenant is not None:
                rows.append((e.name, tenant, int(e.size), float(e.mtime)))
        added = 0
        for i in range(0, len(rows), 1000):  # short transactions: writers of other processes go between
            with self._sqlite.txn() as db:
                before = db.total_changes
                db.executemany("INSERT OR IGNORE INTO backlog VALUES (?, ?, ?, ?, 0, 0, 0, 0)", rows[i:i + 1000])
                added += db.total_changes - before
        return added

    def claim(self, tenants: Collection[str], *, now: float | None = None) -> Pending | None:
        """Take the first row in drain order that no process is uploading, that is not backing
        off at ``now``, and that one of ``tenants`` uploads; ``None`` when there is none.
        The row is this process's until :meth:`done`, :meth:`failed` or :meth:`release`."""
        if not tenants:
            return None
        t = self.clock() if now is None else now
        marks = ",".join("?" * len(tenants))
        with self._sqlite.txn() as db:
            row = db.execute(f"SELECT {_COLUMNS} FROM backlog WHERE pid = 0 AND not_before <= ? "
                             f"AND tenant IN ({marks}) {_ORDER} LIMIT 1", (t, *tenants)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE backlog SET pid = ? WHERE name = ?", (self.pid, row[0]))
        return Pending(*row)

    def done(self, name: str) -> bool:
        """The object is in the remote tiers, or never will be: its row goes. Whether there was one."""
        with self._sqlite.txn() as db:
            return db.execute("DELETE FROM backlog WHERE name = ?", (name,)).rowcount == 1

    def failed(self, name: str, *, retry_at: float) -> int:
        """An upload of a claimed row failed: it waits until ``retry_at``, unclaimed. Its failed attempts so far."""
        with self._sqlite.txn() as db:
            db.execute("UPDATE backlog SET attempts = MIN(attempts + 1, ?), not_before = ?, pid = 0 WHERE name = ?",
                       (MAX_ATTEMPTS_RECORDED, float(retry_at), name))
            row = db.execute("SELECT attempts FROM backlog WHERE name = ?", (name,)).fetchone()
        return 0 if row is None else int(row[0])

    def release(self, name: str | None = None) -> int:
        """Give back this process's claim on ``name`` (every claim of it when ``None``); how many."""
        with self._sqlite.txn() as db:
            if name is None:
                return db.execute("UPDATE backlog SET pid = 0 WHERE pid = ?", (self.pid,)).rowcount
            return db.execute("UPDATE backlog SET pid = 0 WHERE name = ? AND pid = ?", (name, self.pid)).rowcount

    def release_dead(self, *, own: bool = False) -> int:
        """Release the claims of processes that are gone (and, with ``own``, those under this
        process's pid: a process before it had the same pid); how many rows."""
        with self._sqlite.reading():
            pids = [int(r[0]) for r in self._sqlite.db().execute("SELECT DISTINCT pid FROM backlog WHERE pid != 0")]
        gone = [p for p in pids if (own and p == self.pid) or (p != self.pid and not pid_alive(p))]
        if not gone:
            return 0
        with self._sqlite.txn() as db:
            return sum(db.execute("UPDATE backlog SET pid = 0 WHERE pid = ?", (p,)).rowcount for p in gone)

    def rerank(self, ranks: Mapping[str, float]) -> int:
        """Set the rank of each named row that waits (names not waiting are ignored); how many changed."""
        if not ranks:
            return 0
        items = [(float(r), n, float(r)) for n, r in ranks.items()]
        changed = 0
        for i in range(0, len(items), 1000):
            with self._sqlite.txn() as db:
                before = db.total_changes
                db.executemany("UPDATE backlog SET rank = ? WHERE name = ? AND rank != ?", items[i:i + 1000])
                changed += db.total_changes - before
        return changed

    # -- reads ---------------------------------------------------------------
    def count(self, tenants: Collection[str] | None = None) -> int:
        """Rows waiting (those ``tenants`` upload, when given)."""
        return int(self._one("COUNT(*)", tenants))

    def size(self, tenants: Collection[str] | None = None) -> int:
        """Bytes waiting (those ``tenants`` upload, when given)."""
        return int(self._one("COALESCE(SUM(size), 0)", tenants))

    def _one(self, what: str, tenants: Collection[str] | None) -> int:
        where, args = "", ()
        if tenants is not None:
            where, args = f" WHERE tenant IN ({','.join('?' * len(tenants))})", tuple(tenants)
        with self._sqlite.reading():
            return self._sqlite.db().execute(f"SELECT {what} FROM backlog{where}", args).fetchone()[0]

    def next_due(self, tenants: Collection[str]) -> float | None:
        """When the first unclaimed row of ``tenants`` may be tried (``None``: none waits)."""
        if not tenants:
            return None
        with self._sqlite.reading():
            got = self._sqlite.db().execute(
                f"SELECT MIN(not_before) FROM backlog WHERE pid = 0 AND tenant IN ({','.join('?' * len(tenants))})",
                tuple(tenants)).fetchone()[0]
        return None if got is None else float(got)

    def rows(self) -> list[Pending]:
        """Every row, in drain order (claimed and backing-off ones too)."""
        with self._sqlite.reading():
            return [Pending(*r) for r in self._sqlite.db().execute(f"SELECT {_COLUMNS} FROM backlog {_ORDER}")]

    def close_thread(self) -> None:
        """Close the calling thread's connection to the file (its next call opens a new one); an
        in-memory backlog's one connection stays (:meth:`close` ends it)."""
        if not self._sqlite.is_private:
            self._sqlite.close()

    def close(self) -> None:
        """Close the calling thread's connection; an in-memory backlog is closed for good."""
        self._sqlite.close()
