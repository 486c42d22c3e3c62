"""The upload backlog (store/tiers/backlog.py): rows that survive the process, claims, the drain
order, and a damaged file set aside and rebuilt from the tier."""
from __future__ import annotations

import random
import sqlite3
import subprocess
import sys

import pytest

from store.serving.upload_rank import drain_order
from store.tiers.backlog import UploadBacklog
from store.tiers.base import object_name, parse_object_name
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.factories import ACME, BOLT, make_chain, make_root, make_snapshot


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _name(i: int, tenant: str = "acme") -> str:
    return object_name(tenant, f"{i:064x}")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_rows_survive_a_close_and_reopen_and_the_claims_of_the_process_before_are_released(tmp_path) -> None:
    clock = Clock()
    first = UploadBacklog.of_tier(tmp_path, clock=clock)
    assert first.persistent and not first.damaged and first.resumed == 0
    for i in range(3):
        clock.t += 1
        assert first.add(_name(i), "acme", 100 + i, rank=0.0)
    assert not first.add(_name(0), "acme", 999)  # already waiting: left as it is
    claimed = first.claim({"acme"})
    assert claimed is not None and claimed.name == _name(0) and claimed.size == 100 and claimed.enqueued == 1001.0
    first.close()

    again = UploadBacklog.of_tier(tmp_path, clock=clock)  # this pid's claim is an earlier process's now
    assert again.resumed == 3 and again.released == 1
    assert [r.name for r in again.rows()] == [_name(0), _name(1), _name(2)]
    assert again.size() == 303 and again.count({"acme"}) == 3 and again.count({"bolt"}) == 0
    assert again.claim({"acme"}).name == _name(0)  # claimable again
    again.close()


def test_claims_follow_the_drain_order_and_a_rerank_reorders_what_waits(tmp_path) -> None:
    rng = random.Random(3)
    clock = Clock()
    backlog = UploadBacklog.of_tier(tmp_path, clock=clock)
    rows = []
    for i in range(40):
        r, t = rng.choice([0.0, 0.0, 0.2, 0.7]), float(rng.randrange(10))
        backlog.add(_name(i), "acme", 10, rank=r, enqueued=t)
        rows.append((_name(i), r, t))
    assert backlog.rerank({_name(5): 0.95, _name(6): 0.0, "acme/ff/not-waiting.kvw": 0.5}) >= 1
    rows[5], rows[6] = (_name(5), 0.95, rows[5][2]), (_name(6), 0.0, rows[6][2])
    want = [n for n, _, _ in drain_order(rows, rank=lambda x: x[1], enqueued=lambda x: x[2], name=lambda x: x[0])]
    assert [r.name for r in backlog.rows()] == want
    got = []
    while (row := backlog.claim({"acme"})) is not None:
        got.append(row.name)
    assert got == want and got[0] == _name(5)
    backlog.close()


def test_a_claim_skips_other_tenants_rows_claimed_ones_and_ones_backing_off(tmp_path) -> None:
    clock = Clock()
    backlog = UploadBacklog.of_tier(tmp_path, clock=clock)
    backlog.add(_name(1), "acme", 1, enqueued=1.0)
    backlog.add(_name(2, "bolt"), "bolt", 1, enqueued=0.0)
    backlog.add(_name(3), "acme", 1, enqueued=2.0)
    assert backlog.claim(set()) is None
    first = backlog.claim({"acme"})
    assert first is not None and first.name == _name(1)
    assert backlog.failed(first.name, retry_at=clock.t + 30) == 1  # unclaimed, backing off
    assert backlog.claim({"acme"}).name == _name(3)
    assert backlog.claim({"acme"}) is None  # one claimed, one backing off
    assert backlog.next_due({"acme"}) == clock.t + 30
    clock.t += 30
    again = backlog.claim({"acme"})
    assert again is not None and again.name == _name(1) and again.attempts == 1
    assert backlog.release(_name(1)) == 1 and backlog.release() == 1  # the one, then every other claim
    assert backlog.done(_name(3)) and not backlog.done(_name(3))
    assert backlog.claim({"bolt"}).name == _name(2, "bolt")
    with pytest.raises(ValueError):
        backlog.add("../../etc/passwd", "acme", 1)
    backlog.close()


def test_the_claims_of_a_dead_process_are_released(tmp_path) -> None:
    backlog = UploadBacklog.of_tier(tmp_path)
    for i in range(3):
        backlog.add(_name(i), "acme", 1)
    dead = _dead_pid()
    with sqlite3.connect(backlog.path) as db:  # another process's claims: one alive (this one), one dead
        db.execute("UPDATE backlog SET pid = ? WHERE name = ?", (dead, _name(0)))
        db.execute("UPDATE backlog SET pid = ? WHERE name = ?", (backlog.pid, _name(1)))
    assert backlog.release_dead() == 1  # this process's claims are its own business
    assert [r.name for r in [backlog.claim({"acme"}), backlog.claim({"acme"})]] == [_name(0), _name(2)]
    backlog.close()


def test_a_damaged_file_is_set_aside_and_the_tiers_objects_are_enqueued_again(tmp_path) -> None:
    tier = LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)
    store = Store([tier])
    for tenant in (ACME, BOLT):
        root = make_root(tenant)
        for block in make_chain(root, 2):
            assert store.put(tenant, make_snapshot(root, block, tenant=tenant))
    backlog = UploadBacklog.of_tier(tier.root)
    backlog.add(next(tier.entries()).name, "acme", 1)
    backlog.close()
    path = backlog.path
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    path.write_bytes(b"this is not a database" * 100)

    again = UploadBacklog.of_tier(tier.root)
    assert again.damaged and again.repair is not None and again.repair.set_aside is not None
    assert again.count() == 0 and sorted(path.parent.glob("backlog.sqlite.damaged-*"))
    added = again.rescan(tier.entries(), lambda name: "acme" if parse_object_name(name)[0] == "acme" else None)
    assert added == 2 and {r.tenant for r in again.rows()} == {"acme"}  # bolt's are another writer's
    assert again.rescan(tier.entries(), lambda name: parse_object_name(name)[0]) == 2  # only bolt's are new
    again.close()
    store.close()


def test_rows_out_of_bounds_are_dropped_at_open_and_the_backlog_says_it_was_damaged(tmp_path) -> None:
    backlog = UploadBacklog.of_tier(tmp_path)
    backlog.add(_name(1), "acme", 1)
    backlog.close()
    with sqlite3.connect(backlog.path) as db:
        db.execute("INSERT INTO backlog VALUES ('../../x.kvw', 'acme', 1, 0, 0, 0, 0, 0)")
        db.execute("INSERT INTO backlog VALUES (?, 'acme', 1, 0, 7.0, 0, 0, 0)", (_name(2),))
        db.execute("INSERT INTO backlog VALUES (?, 'Not A Tenant', 1, 0, 0, 0, 0, 0)", (_name(3),))
    again = UploadBacklog.of_tier(tmp_path)
    assert again.damaged and again.repair.rows_dropped == 3 and again.repair.set_aside is None
    assert [r.name for r in again.rows()] == [_name(1)]
    again.close()


def test_a_backlog_without_a_file_lives_in_memory_shared_by_threads() -> None:
    backlog = UploadBacklog(None)
    assert not backlog.persistent and backlog.add(_name(1), "acme", 5)
    backlog.close_thread()  # a thread's end leaves the one connection open
    assert backlog.count() == 1 and backlog.claim({"acme"}).name == _name(1)
    backlog.close()
