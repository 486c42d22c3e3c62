"""A real, small file system that a test fills: a tmpfs mounted for one test.

A full disk cannot be faked honestly (``ENOSPC`` comes from the kernel at any write, SQLite's
journal included), so the fixture mounts a tmpfs of a few MiB and :meth:`SmallFS.fill` writes a
filler file until the kernel says no. Mounting needs root (as here and in CI); without it, or
where the mount fails (no privilege in a container), the test is skipped with the reason.
"""
from __future__ import annotations

import errno
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_CHUNKS = (1 << 20, 64 << 10, 4 << 10, 512, 1)


@dataclass(frozen=True)
class SmallFS:
    """A mounted tmpfs of ``size`` bytes at ``path``."""

    path: Path
    size: int

    @property
    def filler(self) -> Path:
        return self.path / "filler"

    def fill(self, *, leave: int = 0) -> None:
        """Write to the filler file until no byte more fits (``ENOSPC``), then give back ``leave``
        bytes (a disk nearly full: small writes fit, a large one does not)."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in _CHUNKS:
                data = b"\0" * chunk
                while True:
                    try:
                        os.write(fd, data)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        st = os.statvfs(self.path)
        assert st.f_bavail == 0, "the file system still has room after filling it"
        if leave:
            os.truncate(self.filler, max(0, self.filler.stat().st_size - leave))

    def free(self) -> None:
        """Remove the filler: the file system has its room back."""
        self.filler.unlink(missing_ok=True)

    def temp_files(self) -> list[Path]:
        """Every temp file a writer left anywhere on the file system (``*.tmp``)."""
        return sorted(p for p in self.path.rglob("*.tmp"))


def mount_small_fs(where: Path, size: int) -> SmallFS:
    """Mount a tmpfs of ``size`` bytes at ``where`` (created); skips the test when that cannot be done."""
    if os.geteuid() != 0:
        pytest.skip("a real full file system needs a tmpfs mount, and mounting needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {where}: {done.stderr.strip() or done.returncode}")
    return SmallFS(where, size)


def unmount(fs: SmallFS) -> None:
    """Unmount (lazily: a mapping still open in the test process must not fail the teardown)."""
    subprocess.run(["umount", "-l", str(fs.path)], capture_output=True)
