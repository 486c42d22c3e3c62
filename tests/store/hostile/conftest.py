"""Fixtures of the hostile tests: a small real file system to fill (tests/store/hostile/full_fs.py)."""
from __future__ import annotations

from typing import Callable, Iterator

import pytest

from tests.store.hostile.full_fs import SmallFS, mount_small_fs, unmount


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Callable[..., SmallFS]]:
    """``small_fs(name, size=...)`` mounts a tmpfs of ``size`` bytes under the test's tmp_path;
    each is unmounted at the end of the test."""
    mounted: list[SmallFS] = []

    def make(name: str = "disk", size: int = 4 << 20) -> SmallFS:
        fs = mount_small_fs(tmp_path / name, size)
        mounted.append(fs)
        return fs

    yield make
    for fs in reversed(mounted):
        unmount(fs)
