"""A full disk under the upload backlog (store/tiers/backlog.py): write-back and its uploads go on,
and a block the backlog cannot record is counted, never lost silently.

On a real small tmpfs (tests/store/hostile/full_fs.py) holding the NVMe tier and its backlog.
"""
from __future__ import annotations

import time

from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.far_tier import FarDir
from tests.store.engines.vllm.upload_setup import name_of, snapshots, uploads, write
from tests.store.factories import ACME


def test_a_backlog_opened_on_a_full_disk_lives_in_memory_and_still_drains(small_fs, tmp_path) -> None:
    fs = small_fs(size=2 << 20)
    local = LocalTier(fs.path / "nvme", cap_bytes=1 << 20)
    snaps = snapshots(2)
    for s in snaps:  # on NVMe before the disk fills
        assert Store([local]).put(ACME, s)
    fs.fill()
    far = FarDir(tmp_path / "far")
    up = uploads(local, Store([far]))
    try:
        assert not up.backlog.persistent  # the file could not be opened: the rows live in memory
        for s in snaps:
            assert up.put(ACME, s)
        assert up.drain(time.monotonic() + HANG_S)
        assert all(far.exists(name_of(s)) for s in snaps)
        assert up.counters.totals()["written_back_uploads"] == 2
    finally:
        up.close()
        fs.free()


def test_a_block_the_backlog_cannot_record_on_a_full_disk_is_counted(small_fs, tmp_path) -> None:
    fs = small_fs(size=4 << 20)
    local = LocalTier(fs.path / "nvme", cap_bytes=1 << 20)
    far = FarDir(tmp_path / "far")
    far.held.clear()
    up = uploads(local, Store([far]))
    try:
        assert up.backlog.persistent
        first = write(local, up, snapshots(1)[0])  # recorded, in flight
        later = snapshots(1, start=1)[0]
        assert Store([local]).put(ACME, later)
        fs.fill()
        big = [later] + snapshots(40, start=2)
        recorded = [up.put(ACME, s) for s in big]  # the WAL grows until the disk says no
        assert not all(recorded)
        totals = up.counters.totals()
        assert totals["upload_dropped:no_space"] == recorded.count(False)
        far.held.set()
        fs.free()
        assert up.drain(time.monotonic() + HANG_S)
        assert far.exists(first)
    finally:
        far.held.set()
        up.close()
        fs.free()
