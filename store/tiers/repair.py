"""Check a shared SQLite file before use; set a damaged one aside, drop rows out of bounds.

The local tier's index (:mod:`store.tiers.index`) and the node's snapshot pool
(:mod:`store.serving.pool`) keep state in SQLite files that any process of the node (or a
careless operator, or a full disk) can damage. Neither holds anything that cannot be had
again: the index is rebuilt from the snapshot files (``LocalTier.reconcile``), the pool
from nothing. So a reader never trusts either blindly and never raises over one: at open,
:func:`repair` checks the file (SQLite's own ``quick_check``, then the schema, object by
object, against the one the owner applies) and sets a damaged file aside for inspection;
a sound file keeps only rows whose every value is of its column's type and within bounds
(``valid``, one SQL condition per table), so that no later query meets a string where it
sums sizes, an infinite expiry, or a name that leads out of the store.
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

log = logging.getLogger("kvwarm.store")

#: SQL: ``x`` is a finite number (SQLite stores NaN as NULL; ``1e999`` is infinite)
FINITE = "(typeof({0}) IN ('integer', 'real') AND {0} BETWEEN -1e18 AND 1e18)"
#: SQL: ``x`` is an integer in ``[lo, hi]``
INTEGER = "(typeof({0}) = 'integer' AND {0} BETWEEN {1} AND {2})"
#: the largest pid Linux hands out (``pid_max`` is at most 2**22)
MAX_PID = 1 << 22
#: the largest file size a row may record (1 TiB: far beyond one snapshot, far below overflow
#: of a sum over millions of rows)
MAX_SIZE = 1 << 40


@dataclass(frozen=True)
class Repair:
    """What :func:`repair` found wrong with a database file and did about it.

    Attributes:
        path: the database file.
        reason: what was wrong.
        set_aside: where the damaged file went (``None``: it was sound, only rows were dropped).
        rows_dropped: rows removed for values out of type or bounds.
    """

    path: str
    reason: str
    set_aside: str | None = None
    rows_dropped: int = 0


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside ``path``: one process checks (and sets aside) at a time, so that a
    second one never sets aside the fresh file the first one made."""
    try:
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # a directory this process cannot write: it cannot set anything aside either
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _objects(db: sqlite3.Connection) -> set[tuple[str, str, str, str | None]]:
    return set(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))


def _damage(db: sqlite3.Connection, schema: str) -> str | None:
    """Why ``db`` cannot be used as it is, or ``None``."""
    check = db.execute("PRAGMA quick_check").fetchall()
    if check != [("ok",)]:
        return f"SQLite finds it damaged: {'; '.join(str(r[0]) for r in check[:3])}"
    want = sqlite3.connect(":memory:")
    try:
        want.executescript(schema)
        expected = _objects(want)
    finally:
        want.close()
    have = _objects(db)
    # A subset is sound: a file another process is creating right now (its schema applied one
    # statement at a time) gets the rest when it is next opened.
    if not have <= expected:
        odd = sorted(str(o[1]) for o in have - expected)
        return f"its schema is not this version's (tables, indexes or triggers differ: {', '.join(odd[:5])})"
    return None


def _drop_invalid(db: sqlite3.Connection, valid: Mapping[str, str], present: set[str]) -> int:
    dropped = 0
    for table, condition in valid.items():
        if table not in present:
            continue
        where = f"NOT COALESCE(({condition}), 0)"
        if db.execute(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE {where})").fetchone()[0]:
            db.execute("BEGIN IMMEDIATE")
            try:
                dropped += db.execute(f"DELETE FROM {table} WHERE {where}").rowcount
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
    return dropped


def _set_aside(path: Path) -> str:
    """Move the database and its WAL and shared-memory files beside it, under a new name."""
    dst = path.with_name(f"{path.name}.damaged-{time.time():.0f}-{secrets.token_hex(4)}")
    for suffix in ("-wal", "-shm"):
        try:
            os.replace(f"{path}{suffix}", f"{dst}{suffix}")
        except FileNotFoundError:
            pass
    os.replace(path, dst)
    return str(dst)


def repair(path: Path, schema: str, valid: Mapping[str, str], *, timeout_s: float) -> Repair | None:
    """Check the database at ``path`` (if there is one) before it is used.

    A file SQLite cannot read, that fails ``quick_check``, or whose tables, indexes or triggers
    are not ``schema``'s is moved aside (``<name>.damaged-<time>-<random>``, with its WAL), so
    that the owner starts a fresh one. In a sound file, rows of each table in ``valid`` for
    which its SQL condition is not true are deleted.

    Never raises for what the file holds. Trouble that is not damage (the file locked past
    ``timeout_s``, a full disk, no permission) is logged and the file left as it is: the
    owner's own use of it then meets the same trouble and reports it as it always did.

    Returns:
        What was done, or ``None`` when the file was sound (or absent).
    """
    if not path.exists():
        return None
    with _locked(path):
        try:
            db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            log.warning("could not check %s: %s", path, exc)
            return None
        try:
            reason = _damage(db, schema)
            dropped = 0 if reason is not None else _drop_invalid(
                db, valid, {o[1] for o in _objects(db) if o[0] == "table"})
        except sqlite3.OperationalError as exc:  # locked, full, I/O: not the file's content
            log.warning("could not check %s: %s", path, exc)
            return None
        except sqlite3.DatabaseError as exc:  # not a database, malformed
            reason = f"SQLite cannot read it: {exc}"
        finally:
            db.close()
        if reason is not None:
            where = _set_aside(path)
            log.error("%s is damaged (%s); set aside to %s and started afresh", path, reason, where)
            return Repair(str(path), reason, set_aside=where)
    if dropped:
        log.error("%s held %d row(s) with values out of type or bounds; dropped", path, dropped)
        return Repair(str(path), f"{dropped} row(s) held values out of type or bounds", rows_dropped=dropped)
    return None
