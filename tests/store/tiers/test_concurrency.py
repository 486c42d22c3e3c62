"""Several processes on one NVMe tier at once (the shared pool of a serving node plus a
prefill worker): no errors, no torn reads, one file per key, and the byte cap holds.

Real processes (fresh interpreters started with ``sys.executable -m tests.store.workers``)
and a real directory; each worker waits on a "go" file so that they all start together.
"""
from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.maintenance import check_object, verify
from store.tiers.store import Store
from tests.store import workers
from tests.store.factories import make_chain, make_root

pytestmark = pytest.mark.slow

N_WORKERS = 4
START_TIMEOUT_S = 300  # hang guards: importing torch in four processes at once is slow on a loaded machine
RUN_TIMEOUT_S = 300


def _run_workers(tmp_path: Path, command: str, base_cfg: dict) -> list[dict]:
    """Start N_WORKERS ``command`` processes, release them together, return their results."""
    go = tmp_path / f"{command}.go"
    cfgs = [{**base_cfg, "worker": w, "go": str(go), "ready": str(tmp_path / f"{command}.{w}.ready"),
             "out": str(tmp_path / f"{command}.{w}.json")} for w in range(N_WORKERS)]
    procs = [subprocess.Popen(workers.command(command, c), cwd=workers.REPO, env=workers.child_env(),
                              stderr=subprocess.PIPE, text=True) for c in cfgs]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S  # a hang guard
        while not all(Path(c["ready"]).exists() for c in cfgs):
            for p in procs:
                if p.poll() is not None:
                    pytest.fail(f"worker exited while starting: {p.stderr.read()}")
            assert time.monotonic() < deadline, "workers never became ready"
            time.sleep(0.01)
        go.touch()
        for p in procs:
            _, err = p.communicate(timeout=RUN_TIMEOUT_S)
            assert p.returncode == 0, f"worker failed:\n{err}"
    finally:
        for p in procs:  # only on failure: these are our own children, by pid
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [json.loads(Path(c["out"]).read_text()) for c in cfgs]


def test_four_processes_writing_and_reading_the_same_keys(tmp_path: Path) -> None:
    root_dir = tmp_path / "nvme"
    n_blocks = 24
    cap = 1 << 30  # no eviction: every key must end up stored exactly once
    tier = LocalTier(root_dir, cap_bytes=cap, recency_flush_s=0.01)
    results = _run_workers(tmp_path, "same_keys", {"root": str(root_dir), "cap": cap, "recency_flush_s": 0.01,
                                                   "n_blocks": n_blocks, "layers": 8, "rounds": 3})

    for w, r in enumerate(results):
        assert r["errors"] == [], f"worker {w}: {r['errors'][:2]}"
        assert r["torn"] == [], f"worker {w}: {r['torn'][:5]}"
        stats = r["stats"]
        assert stats.get("corrupt", 0) == stats.get("mismatched", 0) == stats.get("quarantined", 0) == 0, stats
        assert r["puts"] == 3 * n_blocks and r["gets"] == 2 * r["puts"]
        assert r["hits"] > 0
    # Each key was written once across all processes (the others saw it, or saw it in flight).
    assert sum(r["wrote"] for r in results) == n_blocks
    # Counts that hold in any interleaving. In round 0 the first read of a key anywhere
    # comes before any write of it: at least one miss per key. The winner of a key reads
    # it after its own write and four times more in rounds 1 and 2: at least five hits per
    # key. (And no worker misses everything: that would need all keys in flight at once
    # during its round 1, while at most one write per worker is.)
    assert sum(r["misses"] for r in results) >= n_blocks
    assert sum(r["hits"] for r in results) >= 5 * n_blocks

    key_root = make_root()
    expected = {object_name("acme", b.key) for b in make_chain(key_root, n_blocks)}
    files = {e.name for e in tier.entries()}
    assert files == expected, "exactly one file per key, and nothing else"
    assert list((root_dir / "tmp").iterdir()) == []
    assert list((root_dir / "quarantine").iterdir()) == []
    for name in files:
        assert check_object(tier, name) is None
    with sqlite3.connect(root_dir / "meta" / "index.sqlite") as db:
        rows = db.execute("SELECT name, state FROM entries").fetchall()
    assert sorted(rows) == sorted((n, "ready") for n in expected)
    assert tier.usage() == tier.disk_usage()
    assert verify(Store([tier]), quarantine=False).clean


def test_four_processes_writing_different_keys_never_exceed_the_cap(tmp_path: Path) -> None:
    root_dir = tmp_path / "nvme"
    # Snapshots of 2, 4 or 8 layers x 4 heads x 64 dims: ~17, ~33, ~66 KiB. The cap
    # holds ~12 of the largest: far more than the 4 reservations in flight at once, so
    # eviction always finds room and StoreFull must not happen.
    cap = 800_000
    n_writes = 40
    tier = LocalTier(root_dir, cap_bytes=cap, recency_flush_s=0.01)

    # Each worker samples the bytes the index reserves after each of its writes and reads
    # (one SELECT: exact while the others work, as a walk of the directory is not); what
    # is on disk is measured at rest, at the end.
    results = _run_workers(tmp_path, "diff_keys", {"root": str(root_dir), "cap": cap, "recency_flush_s": 0.01,
                                                   "n_writes": n_writes, "layers": [2, 4, 8]})

    for w, r in enumerate(results):
        assert r["store_full"] == 0, f"worker {w}: {r['errors'][:2]}"
        assert r["errors"] == [], f"worker {w}: {r['errors'][:2]}"
        assert r["over_cap"] == [], f"worker {w}: {r['over_cap'][:5]}"
        assert r["torn"] == [], f"worker {w}: {r['torn'][:5]}"
        assert r["writes"] == n_writes
        assert r["max_index"] <= cap
        assert r["stats"].get("corrupt", 0) == 0
    # The cap was exercised: each worker alone writes more than twice what it holds (its 40
    # seeded snapshots come to 1.8 MB or more), and eviction goes down to 90 % of it, less
    # one snapshot: from its first eviction on, the index holds more than half the cap.
    assert len(list(tier.entries())) < N_WORKERS * n_writes
    assert min(r["max_index"] for r in results) > cap // 2
    assert list((root_dir / "tmp").iterdir()) == []
    assert tier.disk_usage() == tier.usage() <= cap
    assert verify(Store([tier]), quarantine=False).clean


def test_threads_of_one_process_writing_at_once(tmp_path: Path) -> None:
    # The prefill job writes a batch's snapshots from a few threads of one Store.
    import concurrent.futures as cf

    from store.config import parse_config
    from tests.store.factories import ACME, make_snapshot

    store = Store.open(f"file://{tmp_path}", parse_config({}))
    root = make_root()
    chain = make_chain(root, 48)
    snaps = [make_snapshot(root, b, seed=i) for i, b in enumerate(chain)]
    with cf.ThreadPoolExecutor(8) as ex:  # every snapshot twice: one write wins, one is skipped
        wrote = list(ex.map(lambda s: store.put(ACME, s), snaps + snaps))
    assert sum(wrote) == len(snaps)
    assert store.probe(ACME, chain, root).count == len(chain)
    report = verify(store)
    assert report.checked == report.ok == len(snaps)
    store.close()
