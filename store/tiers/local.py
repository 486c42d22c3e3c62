"""The NVMe tier: a local directory, memory-mapped reads, a hard byte cap with LRU.

Layout under the root::

    objects/<tenant>/<kk>/<key>.kvw   snapshots (immutable; readers map them)
    tmp/<key>.<pid>.<rand>.tmp         writes in progress (renamed into objects/)
    quarantine/<tenant>__<key>.<ts>.kvw (+ .reason.json)   corrupt files kept for inspection
    meta/index.sqlite                  sizes, expiry, last access, in-flight reservations

Readers never touch the index on the hot path: they map the file and note the access in memory;
accesses are written to the index at most every ``recency_flush_s``. Writers reserve room in the index
(one SQLite transaction) *before* writing, so the bytes on disk never exceed the cap, even with several
processes writing at once. The index can always be rebuilt from the files (``reconcile``). A full disk
is ordinary: a write that does not fit raises :class:`store.errors.StoreFull` and leaves no temp file;
reads go on (their access records wait in memory), also on a tier opened full.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pyarrow as pa

from store.config import StoreConfig
from store.errors import SnapshotError, StoreError, StoreFull
from store.format.encode import EncodedSnapshot, write_pieces
from store.format.payload import map_file
from store.format.snapshot import read_header
from store.tiers.base import SUFFIX, Entry, Housekeeping, Tier
from store.tiers import quarantine, temp_files
from store.tiers.index import TierIndex, pid_alive
from store.tiers.metadir import MetaDir, make_dirs
from store.tiers.sqlite import full_disk, is_space_error
from store.tiers.urls import file_root

log = logging.getLogger("kvwarm.store")


def encoded_size(data: EncodedSnapshot | bytes | pa.Buffer) -> int:
    """Exact size of the file ``data`` becomes, computed without writing it."""
    return data.file_size if isinstance(data, EncodedSnapshot) else len(data)


def _header_expiry(path: Path, *, default: float) -> float:
    """A snapshot's expiry from its header; ``default`` (expire now, GC then checks it) when unreadable."""
    try:
        return read_header(map_file(path)).expires_at
    except (SnapshotError, OSError):
        return default


class LocalTier(Tier):
    """A directory on local disk. See the module docstring for layout and guarantees.

    Args:
        root: the directory (created if missing).
        cap_bytes: hard ceiling on bytes held (snapshots plus writes in flight).
        recency_flush_s: how often accesses are written to the index.
        evict_to_fraction: when full, evict down to this fraction of the cap.
        clock: time source (tests inject one).
    """

    scheme = "file"
    remote = False
    stores_encoded = True
    mappable = True
    capped = True
    kind = "nvme"

    def __init__(self, root: str | os.PathLike[str], *, cap_bytes: int, recency_flush_s: float = 5.0,
                 evict_to_fraction: float = 0.9, clock: Callable[[], float] = time.time) -> None:
        if cap_bytes <= 0:
            raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")
        self.root = Path(root).expanduser().resolve()
        self.url = f"file://{self.root}"
        self.cap_bytes = int(cap_bytes)
        self.evict_to_fraction = evict_to_fraction
        self.clock = clock
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"
        self._writing: set[str] = set()  # names this process is writing now (pending rows carry only the pid)
        self._writing_lock = threading.Lock()
        self.quarantine_dir = self.root / "quarantine"
        make_dirs(self.objects, self.tmp, self.quarantine_dir)  # on a full disk: what is there is served
        self.meta = MetaDir(self.root / "meta")
        self.index = TierIndex(self.root / "meta" / "index.sqlite", clock=clock, flush_s=recency_flush_s)
        if self.index.fresh:
            try:
                self.reconcile()
            except StoreFull as exc:  # left to the first write, or to GC, once there is room
                log.warning("the local tier's index could not be rebuilt: %s", exc)

    @classmethod
    def from_url(cls, url: str, settings: StoreConfig, *, create_bucket: bool = False) -> "LocalTier":
        """``file:///path`` (``~`` expanded; a relative path is a ConfigError), capped and flushed as ``settings`` say."""
        return cls(file_root(url), cap_bytes=int(settings.nvme_cap), recency_flush_s=settings.recency_flush_s,
                   evict_to_fraction=settings.evict_to_fraction)

    def path(self, name: str) -> Path:
        return self.objects / name

    def usage(self) -> int:
        """Bytes reserved in the index (ready snapshots plus writes in flight)."""
        return self.index.usage()

    def disk_usage(self) -> int:
        """Bytes actually on disk in objects/ and tmp/ (what the cap bounds)."""
        total = 0
        for base in (self.objects, self.tmp):
            for dirpath, _, files in os.walk(base):
                for f in files:
                    try:
                        total += os.stat(os.path.join(dirpath, f)).st_size
                    except FileNotFoundError:
                        pass
        return total

    # -- reads ---------------------------------------------------------------
    def read(self, name: str, *, readahead: bool = False) -> pa.Buffer | None:
        """The file mapped read-only and shared (:func:`store.format.payload.map_file`), or ``None``.

        A plain ``mmap``, not ``pa.memory_map``: Arrow's mapped file advises the kernel on
        every read through it, which cost 1.6 ms of a 6 ms verified read of a 16 MiB
        snapshot (``bench/store_bench.py``). The mapping goes when its last view does.
        ``readahead``: ``MADV_WILLNEED`` once, for a hit about to be used.
        """
        try:
            mm = map_file(self.path(name), willneed=readahead)
        except FileNotFoundError:
            return None
        self.touch(name)
        return mm

    def touch(self, name: str) -> None:
        self.index.note_access(name)

    def bookkeeping_unwritten(self) -> int:
        return self.index.unwritten

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def probe(self, names: Sequence[str]) -> int:
        n = 0
        for name in names:
            if not self.path(name).is_file():
                break
            n += 1
        return n

    # -- writes --------------------------------------------------------------
    def write(self, name: str, data: EncodedSnapshot | bytes | pa.Buffer, *, expires_at: float) -> bool:
        with self._writing_lock:  # another thread of this process writing the same snapshot
            if name in self._writing:
                return False
            self._writing.add(name)
        try:
            return self._write(name, data, expires_at)
        finally:
            with self._writing_lock:
                self._writing.discard(name)

    def _write(self, name: str, data: EncodedSnapshot | bytes | pa.Buffer, expires_at: float) -> bool:
        size = encoded_size(data)
        pid = os.getpid()
        final = self.path(name)
        with self.index.txn() as db:
            row = db.execute("SELECT state, pid FROM entries WHERE name = ?", (name,)).fetchone()
            if row is not None:
                state, owner = row
                if state == "ready" and final.is_file():
                    return False
                if state == "pending" and owner != pid and pid_alive(owner):
                    return False  # another process is writing the same immutable snapshot
                if state == "pending" and owner != pid:  # its writer died
                    if final.is_file():
                        # It died after the rename: the file is complete; adopt it.
                        db.execute(
                            "UPDATE entries SET state = 'ready', size = ? WHERE name = ?",
                            (final.stat().st_size, name),
                        )
                        return False
                    self._unlink_temp_files(name, owner)
                db.execute("DELETE FROM entries WHERE name = ?", (name,))
            elif final.is_file():
                # On disk but not indexed (index rebuilt, or an earlier crash): index it.
                db.execute(
                    "INSERT INTO entries VALUES (?, ?, ?, ?, 'ready', ?)",
                    (name, final.stat().st_size, self.clock(), expires_at, pid),
                )
                return False
            self._make_room(db, size)
            db.execute(
                "INSERT INTO entries VALUES (?, ?, ?, ?, 'pending', ?)",
                (name, size, self.clock(), expires_at, pid),
            )
        tmp = temp_files.temp_path(self.tmp, final.stem, pid)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                write_pieces(fd, data.pieces if isinstance(data, EncodedSnapshot) else (data,))
                os.fsync(fd)
            finally:
                os.close(fd)
            final.parent.mkdir(parents=True, exist_ok=True)
            # NOTE: no directory fsync. Readers see the rename atomically either way; after
            # a power loss a lost rename is only a miss, and the temp file is GC's.
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            # on a full disk the reservation may stay: this process's next write of it, or GC, clears it
            self._index_write(f"releasing the reservation of {name}",
                              "DELETE FROM entries WHERE name = ? AND pid = ? AND state = 'pending'", (name, pid))
            if is_space_error(exc):
                raise full_disk(self.root, exc, f"write snapshot {name}") from exc
            raise
        # INSERT OR REPLACE, not UPDATE: a delete() racing this write may have removed the
        # reservation, and the renamed file must still be counted against the cap. On a full disk
        # the snapshot is in place all the same; its pending row (this pid's) stays counted.
        self._index_write(f"marking {name} ready", "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, 'ready', ?)",
                          (name, size, self.clock(), expires_at, pid))
        return True

    def _index_write(self, what: str, sql: str, args: tuple[object, ...]) -> None:
        """One statement on the index, best effort: on a full disk it is logged (GC's reconcile repairs it)."""
        try:
            with self.index.txn() as db:
                db.execute(sql, args)
        except StoreError as exc:
            log.warning("%s: the index could not be written (%s)", what, exc)

    def _make_room(self, db: sqlite3.Connection, size: int) -> list[str]:
        if size > self.cap_bytes:
            raise StoreFull(
                f"a {size}-byte snapshot cannot fit under the local tier's cap of {self.cap_bytes} bytes; "
                "raise store.nvme_cap or use a smaller block_size"
            )
        used = int(db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0])
        if used + size <= self.cap_bytes:
            return []
        self.index.flush(db)
        goal = self.cap_bytes * self.evict_to_fraction - size
        if goal < 0:
            goal = self.cap_bytes - size
        evicted: list[str] = []
        for name, esize, state, owner in db.execute(
            "SELECT name, size, state, pid FROM entries ORDER BY (expires <= ?) DESC, last_access ASC",
            (self.clock(),),
        ).fetchall():
            if used <= goal:
                break
            if state == "pending":
                if pid_alive(owner):
                    continue
                # A dead writer's reservation: free the bytes it left (its temp file, or
                # the complete file if it died after the rename), not just its row.
                self._unlink_temp_files(name, owner)
            self.path(name).unlink(missing_ok=True)
            db.execute("DELETE FROM entries WHERE name = ?", (name,))
            used -= esize
            evicted.append(name)
        if used + size > self.cap_bytes:
            raise StoreFull(
                f"local tier full: {used} of {self.cap_bytes} bytes are held by writes in flight; retry later"
            )
        return evicted

    def _unlink_temp_files(self, name: str, owner: int) -> None:
        temp_files.unlink_writer_files(self.tmp, self.path(name).stem, owner)

    def delete(self, name: str) -> bool:
        # on a full disk the file still goes (it frees space)
        self._index_write(f"removing {name}", "DELETE FROM entries WHERE name = ?", (name,))
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            return False
        return True

    # -- metadata area -------------------------------------------------------
    def get_meta(self, name: str) -> bytes | None:
        return self.meta.get(name)

    def get_meta_capped(self, name: str, max_bytes: int) -> bytes | None:
        return self.meta.get(name, max_bytes)

    def put_meta(self, name: str, data: bytes) -> None:
        self.meta.put(name, data)

    def list_meta(self, prefix: str) -> list[str]:
        return self.meta.names(prefix)

    # -- listing, quarantine, housekeeping -----------------------------------
    def entries(self, prefix: str = "") -> Iterator[Entry]:
        top = prefix.split("/")[0] if prefix else ""
        base = self.objects / top if top else self.objects
        for dirpath, _, files in os.walk(base):
            for f in sorted(files):
                if not f.endswith(SUFFIX):
                    continue
                full = Path(dirpath) / f
                name = full.relative_to(self.objects).as_posix()
                if not name.startswith(prefix):
                    continue
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue
                yield Entry(name, st.st_size, st.st_mtime)

    def quarantine(self, name: str, reason: str) -> str | None:
        dst = quarantine.move_aside(self.path(name), self.quarantine_dir, name, reason, self.clock())
        if dst is None:
            return None
        self._index_write(f"quarantining {name}", "DELETE FROM entries WHERE name = ?", (name,))
        return str(dst)

    def quarantined(self) -> list[Entry]:
        return quarantine.listing(self.quarantine_dir)

    def stale_temp_files(self, now: float, max_age_s: float = 3600.0) -> list[Path]:
        """Temp files (snapshot writes in tmp/, metadata writes in meta/) whose writer is
        dead (pid in the name) or that are older than ``max_age_s``."""
        return temp_files.stale([*self.tmp.glob("*.tmp"), *self.meta.temp_files()], now, max_age_s)

    def reconcile(self) -> dict[str, int]:
        """Make the index agree with the files: drop rows of missing files and dead
        reservations, index unindexed files. Returns counts of each fix."""
        now = self.clock()
        on_disk = {e.name: e for e in self.entries()}
        fixes = {"dropped": 0, "indexed": 0, "marked_ready": 0}
        with self.index.txn() as db:
            for name, state, owner in db.execute("SELECT name, state, pid FROM entries").fetchall():
                if name in on_disk:
                    if state == "pending" and not pid_alive(owner):
                        # The size is the file's: the row may be a later writer's reservation.
                        db.execute(
                            "UPDATE entries SET state = 'ready', size = ? WHERE name = ?", (on_disk[name].size, name)
                        )
                        fixes["marked_ready"] += 1
                elif state == "ready" or not pid_alive(owner):
                    db.execute("DELETE FROM entries WHERE name = ?", (name,))
                    fixes["dropped"] += 1
            known = {r[0] for r in db.execute("SELECT name FROM entries")}
            for name, e in on_disk.items():
                if name not in known:
                    expires = _header_expiry(self.path(name), default=now)
                    db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, 'ready', 0)", (name, e.size, e.mtime, expires))
                    fixes["indexed"] += 1
        return fixes

    def remove_expired(self, now: float) -> list[Entry]:
        """Delete every snapshot whose recorded expiry is at or before ``now``."""
        removed = []
        with self.index.txn() as db:
            rows = db.execute(
                "SELECT name, size FROM entries WHERE state = 'ready' AND expires <= ?", (now,)
            ).fetchall()
            for name, size in rows:
                self.path(name).unlink(missing_ok=True)
                db.execute("DELETE FROM entries WHERE name = ?", (name,))
                removed.append(Entry(name, size, now))
        return removed

    def housekeep(self, now: float) -> Housekeeping:
        done = Housekeeping()
        for f in self.stale_temp_files(now):
            f.unlink(missing_ok=True)
            done.temp_removed += 1
        try:
            done.index_fixes = self.reconcile()
        except StoreFull as exc:  # the index cannot be written: free what expired by the headers, then catch up
            log.warning("%s; GC removes expired snapshots by their headers first", exc)
            for e in list(self.entries()):
                if _header_expiry(self.path(e.name), default=float("inf")) <= now:
                    self.path(e.name).unlink(missing_ok=True)
                    done.expired_removed += 1
            done.index_fixes = self.reconcile()  # StoreFull still: nothing expired, an operator must free space
        done.expired_removed += len(self.remove_expired(now))
        done.evicted = len(self.trim())
        return done

    def trim(self) -> list[str]:
        """Evict in LRU order until usage is under the cap (after the cap was lowered)."""
        with self.index.txn() as db:
            return self._make_room(db, 0)

    def lru_order(self) -> list[str]:
        """Names from least to most recently used (after flushing this process's accesses)."""
        with self.index.txn() as db:
            self.index.flush(db)
        return [r[0] for r in self.index.db().execute("SELECT name FROM entries WHERE state='ready' ORDER BY last_access")]

    def close(self) -> None:
        self.index.close()
