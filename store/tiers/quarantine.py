"""A local tier's quarantine: snapshot files found corrupt or mismatched, moved aside for inspection.

Nothing here is deleted: ``quarantine/<tenant>__<key>.<time>.<rand>.kvw`` is the file as it was
found, and a ``.reason.json`` note beside it says why. The note is bookkeeping: on a full disk it is
left out (logged), and the read that found the file bad goes on.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

from store.tiers.base import SUFFIX, Entry

log = logging.getLogger("kvwarm.store")


def move_aside(src: Path, directory: Path, name: str, reason: str, at: float) -> Path | None:
    """Move the object ``name`` (file ``src``) into ``directory`` with a note of ``reason``; where it
    went, or ``None`` when the file was not there (another process moved or removed it first)."""
    stamp = f"{at:.6f}"
    # The random part keeps earlier evidence when the same name goes bad twice at one instant.
    dst = directory / f"{name.replace('/', '__')}.{stamp}.{secrets.token_hex(4)}{SUFFIX}"
    try:
        os.replace(src, dst)
    except FileNotFoundError:
        return None
    note = dst.with_suffix(".reason.json")
    try:
        note.write_text(json.dumps({"name": name, "reason": reason, "at": float(stamp)}, indent=1))
    except OSError as exc:
        note.unlink(missing_ok=True)
        log.warning("the quarantine note of %s could not be written: %s", dst, exc)
    return dst


def listing(directory: Path) -> list[Entry]:
    """The quarantined files, by file name."""
    out = []
    for f in sorted(directory.glob(f"*{SUFFIX}")):
        st = f.stat()
        out.append(Entry(f.name, st.st_size, st.st_mtime))
    return out
