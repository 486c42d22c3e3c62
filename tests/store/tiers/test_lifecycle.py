"""TTL expiry, the byte cap, LRU eviction and index reconciliation of the NVMe tier
(single process, injected clock, real files)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from store.errors import StoreFull
from store.tiers.base import object_name
from store.tiers.local import LocalTier, encoded_size
from store.tiers.maintenance import gc
from store.tiers.store import Store
from tests.store.factories import ACME, make_chain, make_root
from tests.store.factories import make_snapshot as _make_snapshot

T0 = 1_800_000_000.0


class Clock:
    """A settable clock shared by a tier and a store."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _open(path: Path, clock: Clock, cap: int = 1 << 30, **kw) -> tuple[Store, LocalTier]:
    tier = LocalTier(path / "nvme", cap_bytes=cap, clock=clock, **kw)
    return Store([tier], clock=clock), tier


def make_snapshot(root, block, **kw):
    """Snapshots created at the test clock's start (the default is the real time)."""
    kw.setdefault("created_at", T0)
    return _make_snapshot(root, block, **kw)


def _name(snap) -> str:
    return object_name("acme", snap.key)


# -- TTL ----------------------------------------------------------------------------
def test_an_expired_snapshot_is_a_counted_miss(tmp_path: Path, clock: Clock) -> None:
    store, tier = _open(tmp_path, clock)
    root = make_root()
    block = make_chain(root, 1)[0]
    store.put(ACME, make_snapshot(root, block, created_at=T0, ttl_s=100))

    snap = store.get(ACME, block, root)
    assert snap is not None and snap.header.expires_at == T0 + 100
    snap.close()
    assert store.get(ACME, block, root, now=T0 + 99.9) is not None
    assert store.stats["expired"] == 0

    clock.t = T0 + 100  # expiry is inclusive
    assert store.get(ACME, block, root) is None
    assert store.get(ACME, block, root, now=T0 + 10_000) is None
    assert store.stats["expired"] == 2
    assert store.stats["misses"] == 2
    assert store.stats["hits"] == 2
    assert tier.exists(object_name("acme", block.key)), "a miss by expiry does not delete: GC does"


def test_gc_removes_expired_snapshots_and_keeps_live_ones(tmp_path: Path, clock: Clock) -> None:
    store, tier = _open(tmp_path, clock)
    root = make_root()
    chain = make_chain(root, 4)
    ttls = [10, 20, 30, 40]
    snaps = [make_snapshot(root, b, created_at=T0, ttl_s=t, seed=i) for i, (b, t) in enumerate(zip(chain, ttls))]
    for s in snaps:
        store.put(ACME, s)

    report = gc(store, now=T0 + 25)
    assert report.expired_removed == 2
    assert {e.name for e in tier.entries()} == {_name(s) for s in snaps[2:]}
    assert tier.usage() == tier.disk_usage() == sum(encoded_size(s) for s in snaps[2:])
    assert store.get(ACME, chain[0], root, now=T0 + 5) is None  # gone, not merely expired
    assert store.get(ACME, chain[2], root, now=T0 + 25) is not None

    clock.t = T0 + 40
    assert len(tier.remove_expired(clock())) == 2
    assert list(tier.entries()) == [] and tier.usage() == tier.disk_usage() == 0


# -- the cap ------------------------------------------------------------------------
def test_random_load_never_exceeds_the_cap(tmp_path: Path, clock: Clock) -> None:
    cap = 200_000
    store, tier = _open(tmp_path, clock, cap=cap, recency_flush_s=3.0)
    root = make_root()
    chain = make_chain(root, 120)
    rng = random.Random(7)
    written: dict[int, object] = {}
    hits = misses = 0
    for step in range(300):
        clock.tick(rng.uniform(0.1, 2.0))
        if not written or rng.random() < 0.45:
            i = rng.randrange(len(chain))
            snap = make_snapshot(root, chain[i], layers=rng.randint(1, 6), heads=rng.choice([1, 2, 4]),
                                 head_dim=rng.choice([8, 32, 64, 128]), seed=i, created_at=clock())
            assert encoded_size(snap) <= cap
            if store.put(ACME, snap) or i not in written:
                written[i] = snap
        else:
            i = rng.choice(list(written))
            got = store.get(ACME, chain[i], root)
            if got is None:
                misses += 1
            else:
                hits += 1
                want = written[i]
                assert got.header.key == chain[i].key
                for part, buf in zip(want.header.parts, want.buffers):
                    assert got.array(part.name).tobytes() == bytes(buf)
                got.close()
        disk, index = tier.disk_usage(), tier.usage()
        assert disk <= cap and index <= cap, f"step {step}: disk {disk}, index {index}, cap {cap}"
        assert disk == index
    assert hits > 20 and misses > 20, (hits, misses)  # the cap forced evictions and reads still hit
    assert store.stats["corrupt"] == 0


@pytest.mark.parametrize("recency_flush_s", [0.0, 3600.0], ids=["flush-every-read", "flush-before-eviction"])
def test_eviction_is_least_recently_used(tmp_path: Path, clock: Clock, recency_flush_s: float) -> None:
    root = make_root()
    a, b, c, d = (make_snapshot(root, blk, seed=i) for i, blk in enumerate(make_chain(root, 4)))
    size = max(encoded_size(s) for s in (a, b, c, d))
    # Fits three; when a fourth comes, evicting one brings usage under 90% of the cap.
    store, tier = _open(tmp_path, clock, cap=int(size * 3.4), recency_flush_s=recency_flush_s)
    for s in (a, b, c):
        clock.tick()
        assert store.put(ACME, s)
    clock.tick()
    got = store.get(ACME, make_chain(root, 4)[0], root)  # read a: now b is the oldest
    assert got is not None
    got.close()
    clock.tick()
    assert store.put(ACME, d)

    names = {e.name for e in tier.entries()}
    assert _name(b) not in names, "b was the least recently used and must be evicted"
    assert names == {_name(a), _name(c), _name(d)}
    assert tier.lru_order() == [_name(c), _name(a), _name(d)]
    assert tier.usage() == tier.disk_usage() <= tier.cap_bytes


def test_a_snapshot_bigger_than_the_cap_is_refused_clearly(tmp_path: Path, clock: Clock) -> None:
    root = make_root()
    block = make_chain(root, 1)[0]
    snap = make_snapshot(root, block, layers=4, heads=4, head_dim=64)
    size = encoded_size(snap)
    cap = size // 2
    store, tier = _open(tmp_path, clock, cap=cap)
    small = make_snapshot(root, make_chain(root, 2)[1], layers=1, heads=1, head_dim=8)
    assert store.put(ACME, small)

    with pytest.raises(StoreFull) as err:
        store.put(ACME, snap)
    msg = str(err.value)
    assert f"{size}-byte snapshot" in msg and f"cap of {cap} bytes" in msg and "nvme_cap" in msg
    # Nothing was evicted for it and nothing was left behind.
    assert {e.name for e in tier.entries()} == {_name(small)}
    assert list(tier.tmp.iterdir()) == []
    assert tier.usage() == tier.disk_usage() == encoded_size(small)
    assert store.get(ACME, block, root) is None


def test_lowering_the_cap_then_gc_trims_in_lru_order(tmp_path: Path, clock: Clock) -> None:
    root = make_root()
    chain = make_chain(root, 6)
    snaps = [make_snapshot(root, b, seed=i) for i, b in enumerate(chain)]
    size = max(encoded_size(s) for s in snaps)
    store, tier = _open(tmp_path, clock, recency_flush_s=3600.0)
    for s in snaps:
        clock.tick()
        store.put(ACME, s)
    # Access order, oldest first: 3, 0, 5, 1, 4, 2
    for i in (3, 0, 5, 1, 4, 2):
        clock.tick()
        store.get(ACME, chain[i], root).close()
    store.close()  # flushes the accesses to the index

    store, tier = _open(tmp_path, clock, cap=int(size * 3.5), recency_flush_s=3600.0)
    report = gc(store)
    assert report.evicted == 3
    # Down to 90% of the new cap (3.15 snapshots): the three most recently used remain.
    assert {e.name for e in tier.entries()} == {_name(snaps[i]) for i in (1, 4, 2)}
    assert tier.lru_order() == [_name(snaps[i]) for i in (1, 4, 2)]
    assert tier.usage() == tier.disk_usage() <= tier.cap_bytes


def test_reconcile_indexes_files_without_index_rows(tmp_path: Path, clock: Clock) -> None:
    root = make_root()
    chain = make_chain(root, 5)
    store, tier = _open(tmp_path, clock)
    snaps = [make_snapshot(root, b, seed=i, created_at=T0, ttl_s=100 * (i + 1)) for i, b in enumerate(chain)]
    for s in snaps:
        store.put(ACME, s)
    before = tier.usage()
    store.close()
    for suffix in ("", "-wal", "-shm"):
        (tier.root / "meta" / f"index.sqlite{suffix}").unlink(missing_ok=True)

    store, tier = _open(tmp_path, clock)  # a fresh index: rebuilt from the files
    assert tier.usage() == before == tier.disk_usage()
    assert sorted(tier.lru_order()) == sorted(_name(s) for s in snaps)
    # Expiry came from each header: gc at T0 + 250 removes the first two.
    assert gc(store, now=T0 + 250).expired_removed == 2
    assert tier.usage() == tier.disk_usage() == sum(encoded_size(s) for s in snaps[2:])

    # Files appearing behind the index's back (copied in by hand) are picked up by reconcile.
    extra = make_snapshot(root, make_chain(root, 6)[5], seed=9, created_at=T0, ttl_s=10**6)
    other_store, other_tier = _open(tmp_path / "elsewhere", clock)
    other_store.put(ACME, extra)
    dst = tier.path(_name(extra))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(other_tier.path(_name(extra)).read_bytes())
    assert tier.usage() != tier.disk_usage()
    fixes = tier.reconcile()
    assert fixes["indexed"] == 1
    assert tier.usage() == tier.disk_usage()


def test_reconcile_drops_rows_of_missing_files(tmp_path: Path, clock: Clock) -> None:
    root = make_root()
    chain = make_chain(root, 3)
    store, tier = _open(tmp_path, clock)
    snaps = [make_snapshot(root, b, seed=i) for i, b in enumerate(chain)]
    for s in snaps:
        store.put(ACME, s)
    tier.path(_name(snaps[1])).unlink()  # removed by hand
    assert tier.usage() > tier.disk_usage()
    assert tier.reconcile()["dropped"] == 1
    assert tier.usage() == tier.disk_usage()
    assert store.get(ACME, chain[1], root) is None
