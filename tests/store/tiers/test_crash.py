"""Crash safety of the NVMe tier (DESIGN.md invariant 4): writers SIGKILLed at random
points never leave a torn snapshot that anyone can read, and GC removes what they leave.

Real processes and real files: a warm "zygote" process forks writer children that this
test kills with SIGKILL at a random point of their writes, while a separate reader
process reads every visible snapshot. Nothing is left to timing: each round waits for
the writer's first write to begin, has the reader make a whole pass while the writer is
alive, then kills it; the rounds go on until each count the test claims is reached. The
disk is measured where a walk is exact, at rest between rounds, and in flight from the
index (one SELECT).
"""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.maintenance import check_object, gc, verify
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store import workers
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

pytestmark = pytest.mark.slow

SEED = 20240611
POOL = 120                 # snapshots the writers work through
MIN_ATTEMPTS = 60          # writes started (and mostly killed) before we stop
MIN_KILLS = 30
MIN_MID_WRITE_KILLS = 30   # kills that landed inside a write
MIN_RAW_READS, MIN_HITS = 20, 5  # what the concurrent reader must have read
#: a hang guard, not a budget: a round is one writer forked, raced by one reader pass,
#: and killed; the minimums above take a few dozen
MAX_ROUNDS = 1000
CAP = 8 * 1024 * 1024      # small enough that writers also evict while being killed


def _pending_rows(db_path: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(db_path) as db:
        return db.execute("SELECT name, pid FROM entries WHERE state = 'pending'").fetchall()


def _index_rows(db_path: Path) -> dict[str, int]:
    with sqlite3.connect(db_path) as db:
        return dict(db.execute("SELECT name, size FROM entries").fetchall())


def _all_tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


def _parse_log(path: Path) -> tuple[dict[int, list[tuple[str, int]]], list[str]]:
    """Per writer pid, its events in order: ("B", i) began write i, ("E", i) finished it,
    ("S", i) found key i already stored and skipped it."""
    events: dict[int, list[tuple[str, int]]] = {}
    failures: list[str] = []
    if not path.exists():
        return events, failures
    for line in path.read_text().splitlines():
        kind, pid, rest = line.split(" ", 2) if line.count(" ") >= 2 else (*line.split(" ", 1), "")
        if kind == "X":
            failures.append(f"writer {pid}: {rest}")
            continue
        fields = rest.split()
        kind = "S" if kind == "E" and fields[1] == "0" else kind  # skipped: the key was already there
        events.setdefault(int(pid), []).append((kind, int(fields[0])))
    return events, failures


class _Procs:
    """Processes this test started, killed by pid (never by name) if the test fails."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.writer: int | None = None  # the zygote's child not yet reaped (it outlives its parent)

    def start(self, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, cwd=workers.REPO, env=workers.child_env(), **kw)
        self.procs.append(p)
        return p

    def cleanup(self) -> None:
        if self.writer is not None:
            try:
                os.kill(self.writer, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def procs():
    ps = _Procs()
    yield ps
    ps.cleanup()


def test_sigkilled_writers_never_leave_a_readable_torn_snapshot(tmp_path: Path, procs: _Procs) -> None:
    root_dir = tmp_path / "nvme"
    log = tmp_path / "writers.log"
    manifest_path = tmp_path / "manifest.json"
    # The parent creates the tier and claims the tenant's namespace first, so that every
    # kill lands in the snapshot write path (the namespace marker is written once).
    tier = LocalTier(root_dir, cap_bytes=CAP, recency_flush_s=0.05)
    store = Store([tier])
    key_root = make_root()
    assert store.put(ACME, make_snapshot(key_root, make_chain(key_root, 1, start=10**6)[0]))

    cfg = {"root": str(root_dir), "cap": CAP, "recency_flush_s": 0.05, "n": POOL, "seed": SEED, "log": str(log),
           "manifest": str(manifest_path)}
    lines = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    zyg = procs.start(workers.command("zygote", cfg), **lines)
    rcfg = {**cfg, "out": str(tmp_path / "reader.json")}
    rdr = procs.start(workers.command("reader", rcfg), **lines)
    assert zyg.stdout.readline().strip() == "ready", "zygote failed to start"
    assert rdr.stdout.readline().strip() == "ready", "reader failed to start"
    manifest = json.loads(manifest_path.read_text())["entries"]

    def ask(proc: subprocess.Popen, line: str) -> str:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline().strip()
        assert answer, f"no answer to {line!r}"
        return answer

    rng = random.Random(SEED)
    start, rounds, kills, mid_write_kills, attempts = 0, 0, 0, 0, 0
    read = {"raw_reads": 0, "hits": 0}
    max_disk_at_rest, garbage_seen = 0, 0
    while (attempts < MIN_ATTEMPTS or kills < MIN_KILLS or mid_write_kills < MIN_MID_WRITE_KILLS
           or read["raw_reads"] < MIN_RAW_READS or read["hits"] < MIN_HITS or not garbage_seen):
        assert rounds < MAX_ROUNDS, (f"{rounds} rounds: {attempts} writes, {kills} kills ({mid_write_kills} "
                                     f"mid-write), {garbage_seen} garbage seen, reader {read}")
        rounds += 1
        variant = kills % 2  # alternate header lengths: a re-written key may change size
        # answered once the writer has begun its first write
        pid = procs.writer = int(ask(zyg, f"fork {start} {variant}").split()[1])
        read = json.loads(ask(rdr, "pass"))  # a whole reader pass while the writer writes
        # Then a random point in whatever write it is in by now: mostly soon, sometimes later.
        time.sleep(rng.choice([rng.uniform(0.0, 0.01), rng.uniform(0.0, 0.06), rng.uniform(0.02, 0.15)]))
        os.kill(pid, signal.SIGKILL)
        status = int(ask(zyg, f"reap {pid}").split()[2])
        procs.writer = None
        events, failures = _parse_log(log)
        assert not failures, failures
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"writer {pid} was not killed by us (wait status {status}): it failed")
        kills += 1
        mine = events.get(pid, [])
        attempts = sum(1 for evs in events.values() for kind, _ in evs if kind == "B") - sum(
            1 for evs in events.values() for kind, _ in evs if kind == "S")
        if mine and mine[-1][0] == "B":
            mid_write_kills += 1
            died_at = mine[-1][1]
            # Half the time retry the key whose write was killed (over the dead writer's
            # reservation and temp file), else move on.
            start = died_at if rng.random() < 0.5 else (died_at + 1) % POOL
        elif mine:
            start = (mine[-1][1] + 1) % POOL
        # At rest (the writer reaped, the reader between passes) the walk is exact. The
        # garbage of killed writers counts against the cap: eviction must free it too, so
        # the files never exceed what the index reserves, and that never exceeds the cap.
        disk, index = tier.disk_usage(), tier.usage()
        max_disk_at_rest = max(max_disk_at_rest, disk)
        assert disk <= index <= CAP, f"after kill {kills}: {disk} bytes on disk, {index} in the index, cap {CAP}"
        garbage_seen += len(_all_tmp_files(root_dir)) + len(_pending_rows(root_dir / "meta" / "index.sqlite"))
    zyg.stdin.write("quit\n")
    zyg.stdin.flush()
    zyg.wait(timeout=HANG_S)
    rdr.stdin.write("quit\n")
    rdr.stdin.flush()
    rdr.wait(timeout=HANG_S)
    assert rdr.returncode == 0, "reader process failed"
    seen = json.loads(Path(rcfg["out"]).read_text())

    # The test did what it claims (the loop ran until it had): enough writes started,
    # kills landed inside writes and left garbage, and the reader read while writers were alive.
    assert attempts >= MIN_ATTEMPTS and kills >= MIN_KILLS and mid_write_kills >= MIN_MID_WRITE_KILLS
    assert seen["passes"] == rounds and seen["raw_reads"] >= MIN_RAW_READS and seen["hits"] >= MIN_HITS, seen

    # No torn snapshot was ever readable by the concurrent reader.
    assert seen["corrupt"] == [], seen["corrupt"][:5]
    assert seen["errors"] == [], seen["errors"][:3]
    assert seen["stats"].get("corrupt", 0) == 0 and seen["stats"].get("quarantined", 0) == 0
    assert seen["max_index"] <= CAP, f"the reader saw {seen['max_index']} bytes reserved, cap {CAP}"

    # Every visible snapshot is complete: bit-identical to one of the two encodings its
    # writer could have produced, and it passes the full check.
    expected = {object_name("acme", m["key"]): set(m["xxh3"]) for m in manifest}
    visible = [e for e in tier.entries("acme/") if e.name in expected]
    assert visible, "no snapshot survived: the test checked nothing"
    for e in visible:
        digest = xxhash.xxh3_64_hexdigest(tier.path(e.name).read_bytes())
        assert digest in expected[e.name], f"{e.name} is not a complete write"
        assert check_object(tier, e.name) is None
    report = verify(store, quarantine=False)
    assert report.clean, report.bad
    assert report.checked == report.ok == len(list(tier.entries()))
    assert not tier.quarantined()

    # The kills left garbage behind (temp files and/or reservations of dead writers;
    # later writers clean some of it up as they retry keys or evict) ...
    db_path = root_dir / "meta" / "index.sqlite"
    assert garbage_seen > 0, "no kill left any garbage: the kills never landed mid-write"
    leftovers = len(_all_tmp_files(root_dir)) + len(_pending_rows(db_path))

    # ... and GC removes it: no temp files, no reservations, index == disk, under the cap.
    gc_report = gc(store)
    assert _all_tmp_files(root_dir) == []
    assert _pending_rows(db_path) == []
    assert tier.usage() == tier.disk_usage(), gc_report.as_dict()
    rows = _index_rows(db_path)
    on_disk = {e.name: e.size for e in tier.entries()}
    assert rows == on_disk
    assert tier.disk_usage() <= CAP
    assert verify(store, quarantine=False).clean

    # Every key reads back as a miss or as exactly its own snapshot; nothing is corrupt.
    chain = make_chain(key_root, POOL)
    hits = 0
    for block in chain:
        snap = store.get(ACME, block, key_root)
        if snap is not None:
            hits += 1
            assert snap.header.key == block.key
            snap.close()
    assert hits == sum(1 for name in on_disk if name in expected)
    assert store.stats["corrupt"] == 0 and store.stats["mismatched"] == 0
    print(f"\ncrash: {rounds} rounds, {kills} kills ({mid_write_kills} mid-write), {attempts} writes started, "
          f"{garbage_seen} garbage seen, {leftovers} left for gc, "
          f"reader {seen['raw_reads']} reads / {seen['hits']} hits, "
          f"max disk at rest {max_disk_at_rest} (cap {CAP}), gc {gc_report.as_dict()}")


# -- the states a SIGKILL leaves at precise points, planted deterministically ----------
# A kill lands at a random point above; these pin the points that matter, by planting
# exactly what a writer killed there leaves: its reservation row (state 'pending',
# its pid, now dead) and its temp file or its renamed, complete file.

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: no zombie answers kill(pid, 0)
    return p.pid


def _plant_reservation(tier: LocalTier, name: str, size: int, pid: int, *, last_access: float = 0.0) -> None:
    with sqlite3.connect(tier.root / "meta" / "index.sqlite") as db:
        db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, 'pending', ?)", (name, size, last_access, 4e9, pid))


def _plant_temp(tier: LocalTier, name: str, pid: int, data: bytes) -> Path:
    path = tier.tmp / f"{tier.path(name).stem}.{pid}.0badf00d.tmp"
    path.write_bytes(data)
    return path


def _plant_final(tier: LocalTier, name: str, data: bytes) -> None:
    tier.path(name).parent.mkdir(parents=True, exist_ok=True)
    tier.path(name).write_bytes(data)


def _snap(root, block, **kw):
    """A snapshot that does not expire during the test (variants are dated 2023)."""
    return make_snapshot(root, block, ttl_s=20 * 365 * 86400, **kw)


def _variant_bytes(snap, v: int) -> bytes:
    from store.format.encode import snapshot_bytes
    return snapshot_bytes(workers._variant(snap, v))


@pytest.fixture
def crash_env(tmp_path: Path):
    tier = LocalTier(tmp_path / "nvme", cap_bytes=1 << 30, recency_flush_s=0)
    store = Store([tier])
    root = make_root()
    yield tier, store, root, make_chain(root, 8)
    store.close()


def test_rewrite_over_a_writer_killed_mid_write_frees_its_temp_file(crash_env) -> None:
    tier, store, root, chain = crash_env
    snap = _snap(root, chain[0])
    name = object_name("acme", snap.key)
    data = _variant_bytes(snap, 0)
    dead = _dead_pid()
    _plant_reservation(tier, name, len(data), dead)
    leftover = _plant_temp(tier, name, dead, data[: len(data) * 3 // 4])

    assert store.put(ACME, snap)  # the dead writer's reservation does not block the key

    assert not leftover.exists(), "the dead writer's temp file was left behind, uncounted"
    assert tier.usage() == tier.disk_usage() == tier.path(name).stat().st_size
    assert check_object(tier, name) is None


def test_rewrite_over_a_writer_killed_after_its_rename_keeps_a_consistent_index(crash_env) -> None:
    tier, store, root, chain = crash_env
    snap = _snap(root, chain[0])
    name = object_name("acme", snap.key)
    data = _variant_bytes(snap, 0)
    _plant_reservation(tier, name, len(data), _dead_pid())
    _plant_final(tier, name, data)

    store.put(ACME, workers._variant(snap, 1))  # a later prefill of the same block

    assert check_object(tier, name) is None
    assert tier.usage() == tier.disk_usage() == tier.path(name).stat().st_size
    assert _pending_rows(tier.root / "meta" / "index.sqlite") == []


def test_gc_after_two_crashes_on_one_key_sizes_the_index_from_the_file(crash_env) -> None:
    """Writer A dies after its rename; writer B re-reserves the key with a different size
    (its header differs: written later) and dies before its rename. GC must index the
    file A left with the file's size, not B's reservation."""
    tier, store, root, chain = crash_env
    snap = _snap(root, chain[0])
    name = object_name("acme", snap.key)
    a_bytes, b_bytes = _variant_bytes(snap, 0), _variant_bytes(snap, 1)
    assert len(a_bytes) != len(b_bytes)
    _plant_final(tier, name, a_bytes)
    b = _dead_pid()
    _plant_reservation(tier, name, len(b_bytes), b)
    _plant_temp(tier, name, b, b_bytes[:100])

    gc(store)

    assert _all_tmp_files(tier.root) == [] and _pending_rows(tier.root / "meta" / "index.sqlite") == []
    assert tier.usage() == tier.disk_usage() == len(a_bytes)
    assert store.get(ACME, chain[0], root) is not None


@pytest.mark.parametrize("left", ["temp file", "renamed file"])
def test_eviction_of_a_dead_writers_reservation_frees_its_bytes(crash_env, left: str) -> None:
    tier, store, root, chain = crash_env
    snaps = [_snap(root, b, seed=i) for i, b in enumerate(chain)]
    size = len(_variant_bytes(snaps[0], 0))
    tier.cap_bytes = cap = int(size * 3.5)
    # The oldest thing in the tier: a reservation whose writer was killed.
    dead, victim = _dead_pid(), snaps[0]
    victim_name = object_name("acme", victim.key)
    data = _variant_bytes(victim, 0)
    _plant_reservation(tier, victim_name, len(data), dead, last_access=1.0)
    if left == "temp file":
        _plant_temp(tier, victim_name, dead, data[: len(data) * 9 // 10])
    else:
        _plant_final(tier, victim_name, data)
    assert tier.disk_usage() <= cap

    for snap in snaps[1:6]:
        store.put(ACME, snap)
        assert tier.disk_usage() <= cap, (
            f"{tier.disk_usage()} bytes on disk, cap {cap}: eviction dropped the dead writer's row "
            "but not its bytes")
        assert tier.disk_usage() <= tier.usage() <= cap  # a partial temp file is under its reservation
    assert victim_name not in {e.name for e in tier.entries()}
    assert _all_tmp_files(tier.root) == []
    assert tier.usage() == tier.disk_usage()
