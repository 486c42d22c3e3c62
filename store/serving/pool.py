"""The node's shared snapshot pool: one byte budget, LRU (or plan priority) and pins, across processes.

Snapshots in the pool are the NVMe tier's own files, mapped read-only with
``MAP_SHARED`` by every serving process that uses them, so N processes hold one
physical copy (the kernel's page cache). What needs coordinating is only *which*
snapshots are in the pool, who pins them, and who attached; that is a small SQLite
table (WAL, ``BEGIN IMMEDIATE``) in ``/dev/shm`` by default, i.e. files and locks, no
daemon (docs/guides/loader.md says why). A crashed process leaves rows naming a dead pid; the
next transaction that needs room clears them.

Rows:
    entries(name, path, size, priority, expires, last_access, admission)
        what the pool holds; ``admission`` is unique per admission, so an entry that was
        evicted and admitted again is never mistaken for the one a process mapped.
    pins(name, pid, count)   a snapshot pinned by a live pid is never evicted.
    attached(pid, budget)    processes attached (at most ``max_instances``); the
        effective budget is the smallest any attached process asked for.
    meta(k, v)               ``epoch``: bumped at every eviction, so processes drop
        mappings of evicted snapshots without asking per snapshot.

A full file system under the pool's directory does not stop serving: when the pool's
database cannot be opened or written for lack of space, this process goes on with a private
pool in its own memory (its own budget, shared with no one: :attr:`SnapshotPool.private`),
logged once, until it restarts.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from store.errors import OperationalError, StoreError, StoreFull
from store.tiers.index import pid_alive
from store.tiers.repair import FINITE, INTEGER, MAX_PID, MAX_SIZE, Repair, repair
from store.tiers.sqlite import LocalDB, is_space_error

T = TypeVar("T")

log = logging.getLogger("kvwarm.pool")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    name TEXT PRIMARY KEY, path TEXT NOT NULL, size INTEGER NOT NULL, priority REAL NOT NULL,
    expires REAL NOT NULL, last_access REAL NOT NULL, admission INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS pins (name TEXT NOT NULL, pid INTEGER NOT NULL, count INTEGER NOT NULL,
                                 PRIMARY KEY (name, pid));
CREATE TABLE IF NOT EXISTS attached (pid INTEGER PRIMARY KEY, budget INTEGER NOT NULL, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('epoch', 0), ('admission', 0);
"""
_COUNTER = 1 << 62  # admission ids and the epoch: far from overflowing ``v + 1``
#: what every row must hold (:func:`store.tiers.repair.repair` drops the others at open)
_VALID = {
    "entries": " AND ".join([
        "typeof(name) = 'text' AND typeof(path) = 'text'", INTEGER.format("size", 0, MAX_SIZE),
        FINITE.format("priority"), FINITE.format("expires"), FINITE.format("last_access"),
        INTEGER.format("admission", 0, _COUNTER)]),
    "pins": f"typeof(name) = 'text' AND {INTEGER.format('pid', 1, MAX_PID)} AND "
            f"{INTEGER.format('count', -(1 << 31), 1 << 31)}",
    "attached": f"{INTEGER.format('pid', 1, MAX_PID)} AND {INTEGER.format('budget', 1, 1 << 62)} AND "
                f"{FINITE.format('since')}",
    "meta": f"k IN ('epoch', 'admission') AND {INTEGER.format('v', 0, _COUNTER)}",
}


class PoolAttachRefused(StoreError, OperationalError):
    """``max_shared_instances`` processes are already attached to this node's pool."""


@dataclass(frozen=True)
class Admit:
    """A snapshot to pin: its object name, the file mapped, its size and retention priority."""

    name: str
    path: str
    size: int
    expires: float
    priority: float | None = None


def default_pool_dir(tier_url: str) -> Path:
    """``/dev/shm/kvwarm-pool-<digest of the mapped tier's URL>``: one pool per tier per node."""
    digest = hashlib.sha256(tier_url.encode()).hexdigest()[:16]
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"kvwarm-pool-{digest}"


class SnapshotPool:
    """One process's handle on the node's pool.

    Args:
        directory: where the pool's state lives (shared by every process of the node).
        budget_bytes: the most snapshot bytes this process wants the node to keep mapped.
        max_instances: processes that may attach at once (``kv_cache.max_shared_instances``).
        clock: time source for LRU and expiry.
    """

    def __init__(self, directory: str | os.PathLike[str], *, budget_bytes: int, max_instances: int,
                 clock: Callable[[], float] = time.time) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"pool_bytes must be a positive number of bytes, got {budget_bytes}")
        if max_instances < 1:
            raise ValueError(f"max_shared_instances must be at least 1, got {max_instances}")
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.max_instances = int(max_instances)
        self.clock = clock
        self.pid = os.getpid()
        self.attached = False
        self.last_usage = 0  # pool bytes and budget as the last pin() saw them (for gauges)
        self.last_budget = self.budget_bytes
        # synchronous=OFF: node-local, rebuilt from nothing after a reboot (or when damaged: what
        # the pool held is only mapped again on the next lookups)
        path = self.directory / "pool.sqlite"
        self.repair: Repair | None = None
        self._sqlite = LocalDB(path, _SCHEMA, synchronous="OFF", timeout_s=60)
        self._switch = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.repair = repair(path, _SCHEMA, _VALID, timeout_s=60)
            self.db()
        except (StoreFull, OSError) as exc:
            if not isinstance(exc, StoreFull) and not is_space_error(exc):
                raise
            self._go_private(exc)

    # -- plumbing ------------------------------------------------------------
    @property
    def private(self) -> bool:
        """Whether this process keeps a private pool in memory (the node's could not be written)."""
        return self._sqlite.is_private

    def db(self) -> sqlite3.Connection:
        return self._sqlite.db()

    def _txn(self) -> AbstractContextManager[sqlite3.Connection]:
        return self._sqlite.txn()

    def _write(self, body: Callable[[sqlite3.Connection], T]) -> T:
        """``body`` in a write transaction; on a full disk, again in this process's private pool."""
        try:
            with self._txn() as db:
                return body(db)
        except StoreFull as exc:
            if self.private:
                raise
            self._go_private(exc)
        with self._txn() as db:
            return body(db)

    def _read(self, body: Callable[[sqlite3.Connection], T]) -> T:
        """``body`` on this thread's connection; a full disk that stops it opening: the private pool."""
        try:
            with self._sqlite.reading():
                return body(self.db())
        except StoreFull as exc:
            if self.private:
                raise
            self._go_private(exc)
        with self._sqlite.reading():
            return body(self.db())

    def _go_private(self, exc: BaseException) -> None:
        """Carry on with a pool in this process's memory: the node's cannot be written (``exc``).

        Its epoch and admission ids start past any the node's pool gave, so no mapping this
        process holds is taken for one admitted into the private pool."""
        with self._switch:
            if not self.private:  # another thread may have switched meanwhile
                self._open_private(exc)

    def _open_private(self, exc: BaseException) -> None:
        log.warning("the node's snapshot pool in %s cannot be written (%s): this process keeps a private pool "
                    "in memory (not shared with the node's other serving processes) until it restarts; free "
                    "space there or set loader.pool_dir to a file system with room", self.directory, exc)
        start = 1 << 40
        try:
            with self._sqlite.reading():
                start = max(start, 1 + max(v for _, v in self.db().execute("SELECT k, v FROM meta")))
        except (StoreError, sqlite3.Error, ValueError):
            pass
        self._sqlite.close()
        self._sqlite = LocalDB.private(_SCHEMA, name=f"pool-{self.pid}")
        with self._txn() as db:
            db.execute("UPDATE meta SET v = ?", (start,))
            if self.attached:
                db.execute("INSERT INTO attached VALUES (?, ?, ?)", (self.pid, self.budget_bytes, self.clock()))

    @staticmethod
    def _live_pids(db: sqlite3.Connection) -> None:
        """Drop pins and attachments of processes that are gone (crashed or exited)."""
        pids = {r[0] for r in db.execute("SELECT pid FROM pins UNION SELECT pid FROM attached")}
        dead = [(p,) for p in pids if not pid_alive(p)]
        if dead:
            db.executemany("DELETE FROM pins WHERE pid = ?", dead)
            db.executemany("DELETE FROM attached WHERE pid = ?", dead)

    def _budget(self, db: sqlite3.Connection) -> int:
        row = db.execute("SELECT MIN(budget) FROM attached").fetchone()
        return int(row[0]) if row and row[0] is not None else self.budget_bytes

    # -- attaching -----------------------------------------------------------
    def attach(self) -> None:
        """Register this process (idempotent).

        Raises:
            PoolAttachRefused: ``max_instances`` live processes are attached already.
        """
        self._write(self._attach)
        self.attached = True

    def _attach(self, db: sqlite3.Connection) -> None:
        self._live_pids(db)
        if db.execute("SELECT 1 FROM attached WHERE pid = ?", (self.pid,)).fetchone() is None:
            n = db.execute("SELECT COUNT(*) FROM attached").fetchone()[0]
            if n >= self.max_instances:
                raise PoolAttachRefused(
                    f"{n} processes are attached to the snapshot pool in {self.directory} "
                    f"(kv_cache.max_shared_instances = {self.max_instances}); raise it or run fewer "
                    "serving processes on this node")
            db.execute("INSERT INTO attached VALUES (?, ?, ?)", (self.pid, self.budget_bytes, self.clock()))
        # A smaller budget than the pool's holds from now: make it true for what is unpinned.
        self._evict(db, 0, self._budget(db))

    def detach(self) -> None:
        """Release this process's pins and attachment (its mappings go with the process)."""
        def detach(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM pins WHERE pid = ?", (self.pid,))
            db.execute("DELETE FROM attached WHERE pid = ?", (self.pid,))

        self._write(detach)
        self.attached = False

    # -- pins ----------------------------------------------------------------
    def pin(self, items: Sequence[Admit]) -> list[int]:
        """Pin ``items`` in order, admitting those not in the pool (evicting others as needed).

        Stops at the first item that cannot fit; returns the admission ids of those pinned
        (a prefix of ``items``). A pinned snapshot stays in the pool until :meth:`unpin`.
        """
        return self._write(lambda db: self._pin(db, items, self.clock()))

    def _pin(self, db: sqlite3.Connection, items: Sequence[Admit], now: float) -> list[int]:
        ids: list[int] = []
        budget = self._budget(db)
        for it in items:
            row = db.execute("SELECT admission FROM entries WHERE name = ?", (it.name,)).fetchone()
            if row is None:
                if not self._evict(db, it.size, budget):
                    break
                adm = db.execute("UPDATE meta SET v = v + 1 WHERE k = 'admission' RETURNING v").fetchone()[0]
                db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (it.name, it.path, it.size, it.priority or 0.0, it.expires, now, adm))
            else:
                adm = row[0]
                db.execute("UPDATE entries SET last_access = ?, priority = COALESCE(?, priority) WHERE name = ?",
                           (now, it.priority, it.name))
            db.execute("INSERT INTO pins VALUES (?, ?, 1) ON CONFLICT(name, pid) DO UPDATE SET count = count + 1",
                       (it.name, self.pid))
            ids.append(int(adm))
        self.last_usage = int(db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0])
        self.last_budget = budget
        return ids

    def unpin(self, names: Sequence[str]) -> None:
        """Undo one :meth:`pin` of each name by this process."""
        if not names:
            return
        def unpin(db: sqlite3.Connection) -> None:
            db.executemany("UPDATE pins SET count = count - 1 WHERE name = ? AND pid = ?",
                           [(n, self.pid) for n in names])
            db.execute("DELETE FROM pins WHERE count <= 0")

        self._write(unpin)

    def _evict(self, db: sqlite3.Connection, size: int, budget: int) -> bool:
        """Make room for ``size`` bytes under ``budget``; ``False`` if pinned bytes prevent it.

        Order: expired first, then lowest retention priority, then least recently used.
        """
        used = int(db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0])
        if used + size <= budget:
            return True
        if size > budget:
            return False
        self._live_pids(db)
        victims = db.execute(
            "SELECT name, path, size FROM entries e WHERE NOT EXISTS "
            "(SELECT 1 FROM pins p WHERE p.name = e.name AND p.count > 0) "
            "ORDER BY (expires <= ?) DESC, priority ASC, last_access ASC", (self.clock(),)).fetchall()
        chosen = []
        for name, path, esize in victims:
            if used + size <= budget:
                break
            chosen.append((name, path))
            used -= esize
        if used + size > budget:
            return False  # evict nothing: the room cannot be made anyway
        if chosen:
            db.executemany("DELETE FROM entries WHERE name = ?", [(n,) for n, _ in chosen])
            db.execute("UPDATE meta SET v = v + 1 WHERE k = 'epoch'")
            for _, path in chosen:
                _drop_page_cache(path)
        return True

    # -- what is there -------------------------------------------------------
    def epoch(self) -> int:
        """Changes whenever something is evicted (cheap to poll)."""
        return self._read(lambda db: int(db.execute("SELECT v FROM meta WHERE k = 'epoch'").fetchone()[0]))

    def admissions(self, names: Sequence[str]) -> dict[str, int]:
        """Admission ids of those ``names`` that are in the pool now."""
        if not names:
            return {}
        marks = ",".join("?" * len(names))
        return self._read(lambda db: {n: int(a) for n, a in db.execute(
            f"SELECT name, admission FROM entries WHERE name IN ({marks})", list(names))})

    def usage(self) -> int:
        """Bytes the pool holds now (all processes)."""
        return self._read(lambda db: int(db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]))

    def budget(self) -> int:
        """The effective node budget (the smallest any attached process asked for)."""
        return self._read(self._budget)

    def pinned_bytes(self) -> int:
        """Bytes of snapshots pinned by live processes."""
        return self._read(lambda db: int(db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM entries e WHERE EXISTS "
            "(SELECT 1 FROM pins p WHERE p.name = e.name AND p.count > 0)").fetchone()[0]))

    def instances(self) -> list[int]:
        """Pids attached now."""
        return self._read(lambda db: [r[0] for r in db.execute("SELECT pid FROM attached ORDER BY pid")])

    def close(self) -> None:
        """Detach (if attached) and close this thread's connection."""
        if self.attached:
            try:
                self.detach()
            except (sqlite3.Error, StoreError) as exc:  # closing must not fail a shutting-down server
                log.warning("detaching from the snapshot pool failed: %s", exc)
        self._sqlite.close()


def _fadvise(path: str | os.PathLike[str], advice: int) -> None:
    """Best-effort page-cache advice on a whole file (a missing file or no support: nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except OSError:
        pass
    finally:
        os.close(fd)


def _drop_page_cache(path: str) -> None:
    """Tell the kernel an evicted snapshot's pages may go (no effect on pages still mapped)."""
    _fadvise(path, os.POSIX_FADV_DONTNEED)


def readahead(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to read a snapshot into the page cache now (asynchronously)."""
    _fadvise(path, os.POSIX_FADV_WILLNEED)
