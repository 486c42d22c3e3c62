"""A local tier's metadata area: small files (namespace owners, run results) written atomically.

Not snapshots: nothing here counts against the tier's cap or is evicted. A write goes
to a temp file named ``.<name>.<pid>.<rand>.tmp`` beside its target, is fsynced and
renamed, and the directory is fsynced, so a reader sees the old file or the new one;
GC removes the temp files of writers that died (:meth:`store.tiers.local.LocalTier.stale_temp_files`).
A write that fails removes its temp file itself; one that fails for space raises
:class:`store.errors.StoreFull`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

from store.errors import StoreRecordInvalid
from store.tiers.base import meta_too_large
from store.tiers.sqlite import full_disk, is_space_error
from store.tiers.temp_files import temp_path

log = logging.getLogger("kvwarm.store")


def make_dirs(*dirs: Path) -> None:
    """Create ``dirs`` (with their parents) if missing. On a full disk each that cannot be made is
    logged and left: a tier serves what it holds, and a write that needs one raises then."""
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if not is_space_error(exc):
                raise
            log.warning("%s cannot be created: %s", d, exc)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MetaDir:
    """Small files under ``root`` (created if missing), by relative name (``tenants/acme.json``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        make_dirs(root)

    def _path(self, name: str) -> Path:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"invalid metadata name {name!r}")
        return self.root / name

    def get(self, name: str, max_bytes: int | None = None) -> bytes | None:
        """The file's bytes, or ``None`` if there is none.

        With ``max_bytes``, a file over it is refused from its size, before it is read, and no
        more than its size is read (a file that grows meanwhile is refused too: writes here
        replace files whole).

        Raises:
            StoreRecordInvalid: the file holds more than ``max_bytes`` bytes.
        """
        try:
            if max_bytes is None:
                return self._path(name).read_bytes()
            with open(self._path(name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise meta_too_large(f"{self.root / name}", size, max_bytes)
                data = f.read(size)  # read(n) sizes its buffer by n: never by the cap
                if f.read(1):
                    raise StoreRecordInvalid("the file grew while it was read, but writes here replace files "
                                             "whole: remove or repair it", location=str(self.root / name))
        except FileNotFoundError:
            return None
        return data

    def put(self, name: str, data: bytes) -> None:
        """Replace the file atomically (and durably).

        Raises:
            StoreFull: the file system has no room for it (nothing of the write is left).
        """
        path = self._path(name)
        tmp = temp_path(path.parent, f".{path.name}", os.getpid())
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and is_space_error(exc):
                raise full_disk(self.root, exc, f"write {name}") from exc
            raise
        _fsync_dir(path.parent)

    def names(self, prefix: str) -> list[str]:
        """Names (relative, ``/``-separated) of the files whose names start with ``prefix``, sorted;
        temp files of writes in progress are left out."""
        head, _, _ = prefix.rpartition("/")
        base = self._path(head) if head else self.root
        if not base.is_dir():
            return []
        found = []
        for path in base.rglob("*"):
            if (path.name.startswith(".") and path.name.endswith(".tmp")) or not path.is_file():
                continue
            name = path.relative_to(self.root).as_posix()
            if name.startswith(prefix):
                found.append(name)
        return sorted(found)

    def temp_files(self) -> Iterator[Path]:
        """Temp files of writes in progress (or of writers that died)."""
        return self.root.rglob(".*.tmp")
