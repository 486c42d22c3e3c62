"""The node's shared pool: budget, pins, retention order, instances, and sharing across real processes."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store.serving.pool import Admit, SnapshotPool
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.pool_workers import config, prompt, pss_kib, synthetic_prefix

REPO = Path(__file__).resolve().parents[3]


def admit(name: str, size: int = 100, *, expires: float = 1e12, priority: float | None = None) -> Admit:
    return Admit(name, f"/nonexistent/{name}", size, expires, priority)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_budget_lru_and_pins(tmp_path):
    t = [1000.0]
    pool = SnapshotPool(tmp_path, budget_bytes=300, max_instances=4, clock=lambda: t[0])
    pool.attach()
    for name in ("a", "b", "c"):
        t[0] += 1
        assert len(pool.pin([admit(name)])) == 1
    pool.unpin(["a", "b"])  # c stays pinned
    t[0] += 1
    pool.pin([admit("a")])  # a is used again: b is now the least recent
    pool.unpin(["a"])
    assert pool.usage() == 300
    assert len(pool.pin([admit("d")])) == 1  # evicts b
    assert set(pool.admissions(["a", "b", "c", "d"])) == {"a", "c", "d"}
    pool.unpin(["d"])
    # c and d pinned? only c: room for 200 more means evicting a and d, never c
    assert len(pool.pin([admit("e", 200)])) == 1
    assert set(pool.admissions(["a", "c", "d", "e"])) == {"c", "e"}
    # everything pinned: the next one does not fit, and nothing is evicted trying
    epoch = pool.epoch()
    assert pool.pin([admit("f")]) == []
    assert pool.epoch() == epoch and pool.usage() == 300 and pool.pinned_bytes() == 300
    assert pool.pin([admit("g", 400)]) == []  # larger than the budget
    pool.close()


def test_expired_first_then_plan_priority_then_lru(tmp_path):
    t = [1000.0]
    pool = SnapshotPool(tmp_path, budget_bytes=300, max_instances=4, clock=lambda: t[0])
    pool.attach()
    pool.pin([admit("old-but-scored", priority=5.0), admit("recent"), admit("expiring", expires=1005.0)])
    pool.unpin(["old-but-scored", "recent", "expiring"])
    t[0] = 1010.0
    pool.pin([admit("x")])
    assert "expiring" not in pool.admissions(["expiring"])  # expired goes first
    pool.pin([admit("y")])
    assert set(pool.admissions(["old-but-scored", "recent"])) == {"old-but-scored"}  # priority beats recency
    pool.close()


def test_a_dead_process_pins_and_slot_are_reclaimed(tmp_path):
    pool = SnapshotPool(tmp_path, budget_bytes=100, max_instances=1)
    gone = dead_pid()
    with pool._txn() as db:  # what a crashed process leaves behind
        db.execute("INSERT INTO attached VALUES (?, 100, 0)", (gone,))
        db.execute("INSERT INTO entries VALUES ('z', '/x', 100, 0, 1e12, 0, 99)")
        db.execute("INSERT INTO pins VALUES ('z', ?, 1)", (gone,))
    pool.attach()  # its slot is free again
    assert pool.instances() == [pool.pid]
    assert len(pool.pin([admit("w")])) == 1  # its pin no longer holds z
    pool.close()


def test_max_shared_instances_is_honoured_across_processes(tmp_path):
    pool = SnapshotPool(tmp_path, budget_bytes=100, max_instances=1)
    pool.attach()
    code = ("import sys; from store.serving.pool import SnapshotPool, PoolAttachRefused\n"
            f"p = SnapshotPool({str(tmp_path)!r}, budget_bytes=100, max_instances=1)\n"
            "try:\n    p.attach()\nexcept PoolAttachRefused as e:\n    print('refused:', e); sys.exit(3)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 3 and "max_shared_instances = 1" in run.stdout
    pool.detach()
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stdout + run.stderr
    with pytest.raises(ValueError):
        SnapshotPool(tmp_path, budget_bytes=0, max_instances=1)


def test_a_loader_over_max_shared_instances_serves_misses(tmp_path, monkeypatch):
    import store.serving.pool as pool_mod
    from store.serving.loader import KVLoader
    from tests.store.pool_workers import ACME, TINY

    cfg = config(16, "bf16", max_shared_instances=1)
    other = dead_pid()  # stands for another serving process that holds the only slot
    real_alive = pool_mod.pid_alive
    monkeypatch.setattr(pool_mod, "pid_alive", lambda pid: pid == other or real_alive(pid))
    holder = SnapshotPool(tmp_path / "pool", budget_bytes=1 << 20, max_instances=1)
    with holder._txn() as db:
        db.execute("INSERT INTO attached VALUES (?, ?, 0)", (other, 1 << 20))
    ld = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, pool_bytes=1 << 20, config=cfg,
                  pool_dir=tmp_path / "pool")
    assert not ld.pool.attached
    assert ld.lookup(prompt(40)) is None
    assert ld.stats()["misses_by_reason"] == {"max_shared_instances": 1}
    ld.close()


def _spawn(mode: str, tmp_path: Path, ids_file: Path, budget: int, block_size: int, **extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.store.pool_workers", mode, "--store", str(tmp_path / "nvme"),
           "--pool", str(tmp_path / "pool"), "--ids", str(ids_file), "--budget", str(budget),
           "--block-size", str(block_size)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(cond, timeout_s: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for p in procs:
            assert p.poll() is None, f"a worker exited while waiting for {what}: {p.communicate()}"
        time.sleep(0.05)


def test_four_processes_share_one_physical_copy(tmp_path):
    bs = 256
    cfg = config(bs, "bf16")
    ids = prompt(12 * bs + 1, seed=50)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    synthetic_prefix(store, cfg, ids[: 12 * bs], layers=8, heads=8, head_dim=128)  # 12 x 8 MiB
    store.close()
    payload = sum(p.stat().st_size for p in (tmp_path / "nvme" / "objects").rglob("*.kvw"))
    assert 90 << 20 < payload < 110 << 20
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(ids))
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [_spawn("share", tmp_path, ids_file, 1 << 30, bs, sync=sync) for _ in range(4)]
    try:
        _wait(lambda: len(list(sync.glob("ready.*"))) == 4, HANG_S, "workers to attach", procs)
        before = sum(pss_kib(p.pid) for p in procs)
        (sync / "go").touch()
        _wait(lambda: len(list(sync.glob("loaded.*"))) == 4, HANG_S, "workers to load", procs)
        after = sum(pss_kib(p.pid) for p in procs)
        loaded = [json.loads(f.read_text()) for f in sync.glob("loaded.*")]
        (sync / "stop").touch()
        for p in procs:
            out, err = p.communicate(timeout=HANG_S)
            assert p.returncode == 0, out + err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert len({x["sum"] for x in loaded}) == 1 and all(x["tokens"] == 12 * bs for x in loaded)
    grown = (after - before) * 1024
    # every process touched all ~100 MB; the node holds it about once, not four times
    assert 0.7 * payload < grown < 1.5 * payload, (grown / payload, before, after)


def test_random_load_from_four_processes_keeps_budget_and_pins(tmp_path):
    bs = 16
    cfg = config(bs, "bf16")
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    prefixes = [prompt(4 * bs + 1, seed=100 + i) for i in range(10)]
    for i, ids in enumerate(prefixes):
        synthetic_prefix(store, cfg, ids[: 4 * bs], layers=2, heads=2, head_dim=8, seed=i)
    store.close()
    one = max(p.stat().st_size for p in (tmp_path / "nvme" / "objects").rglob("*.kvw"))
    budget = 12 * one  # 40 blocks stored, room for 12: constant eviction, and sometimes all pinned
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(prefixes))
    sync = tmp_path / "sync"
    sync.mkdir()
    lookups = 200
    procs = [_spawn("churn", tmp_path, ids_file, budget, bs, sync=sync, lookups=lookups, workers=4, seed=i)
             for i in range(4)]
    results = []
    try:
        _wait(lambda: len(list(sync.glob("ready.*"))) == 4, HANG_S, "workers to attach", procs)
        (sync / "go").touch()  # all four churn at once
        for p in procs:
            out, err = p.communicate(timeout=HANG_S)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    pool = SnapshotPool(tmp_path / "pool", budget_bytes=budget, max_instances=8)
    assert pool.usage() <= budget and pool.pinned_bytes() == 0 and pool.instances() == []
    for r in results:
        assert r["lookups"] == lookups, r
        assert r["pinned_evicted"] == 0 and r["over_budget"] == 0 and r["bad_data"] == 0, r
        assert r["max_usage"] <= budget
        # the closing sweep (tests/store/pool_workers.py says why every one of its lookups hits)
        assert (r["sweep_hits"], r["sweep_tokens"]) == (len(prefixes), len(prefixes) * 2 * bs), r
    assert pool.epoch() > 0  # evictions did happen (each sweep alone must evict)
