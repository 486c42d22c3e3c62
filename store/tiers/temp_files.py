"""Temp files of writes in progress in a local tier: how they are named, and which a dead writer left.

A write goes to a temp file whose name carries its writer's pid (``<stem>.<pid>.<rand>.tmp``:
snapshots in ``tmp/``, metadata files as ``.<name>.<pid>.<rand>.tmp`` beside their target) and is
renamed into place. A write that fails removes its own; GC removes those of writers that died.
"""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Iterable

from store.tiers.index import pid_alive


def temp_path(directory: Path, stem: str, pid: int) -> Path:
    """A fresh temp file name for writer ``pid``'s write of ``stem``."""
    return directory / f"{stem}.{pid}.{secrets.token_hex(4)}.tmp"


def unlink_writer_files(directory: Path, stem: str, pid: int) -> None:
    """Remove the temp files writer ``pid`` left for ``stem`` in ``directory``."""
    for f in directory.glob(f"{stem}.{pid}.*.tmp"):
        f.unlink(missing_ok=True)


def stale(candidates: Iterable[Path], now: float, max_age_s: float) -> list[Path]:
    """Those ``candidates`` whose writer is dead (the pid in the name) or that are older than ``max_age_s``."""
    out = []
    for f in candidates:
        try:
            pid = int(f.name.split(".")[-3])
        except (ValueError, IndexError):
            pid = -1
        try:
            age = now - f.stat().st_mtime
        except FileNotFoundError:
            continue
        if pid <= 0 or not pid_alive(pid) or age > max_age_s:
            out.append(f)
    return out
