"""The Store over one tier (each registered tier in turn): put/get/probe/list/stat/delete
semantics; and the store URLs the registry accepts."""
from __future__ import annotations

from pathlib import Path

import pytest

from store.config import parse_config
from store.errors import ConfigError, SnapshotCorrupt
from store.miss import MissReason
from store.tiers.base import object_name
from store.tiers.registry import tiers_from_url
from store.tiers.store import Store
from tests.store.factories import ACME, make_chain, make_kv, make_root, make_snapshot


@pytest.fixture()
def store(tier_case) -> Store:
    return Store([tier_case.tier])


def test_put_is_idempotent_and_get_returns_the_data(store: Store) -> None:
    root = make_root()
    block = make_chain(root, 1)[0]
    snap = make_snapshot(root, block, seed=3)
    assert store.put(ACME, snap) is True
    assert store.put(ACME, snap) is False
    got = store.get(ACME, block, root)
    assert got is not None
    k, _ = got.layer(0)
    ref = make_kv(root, seed=3)[0][0]
    assert float((k - ref).norm() / ref.norm()) < 0.05
    assert store.stats["writes"] == 1 and store.stats["writes_skipped"] == 1 and store.stats["hits"] == 1


def test_probe_counts_leading_blocks_only(store: Store) -> None:
    root = make_root()
    chain = make_chain(root, 5)
    for b in (chain[0], chain[1], chain[3]):  # a gap at block 2
        store.put(ACME, make_snapshot(root, b))
    p = store.probe(ACME, chain, root)
    assert (p.count, p.tier) == (2, store.tiers[0].kind)
    assert store.probe(ACME, [], root).count == 0


def test_miss_is_none_not_an_error(store: Store) -> None:
    root = make_root()
    assert store.get(ACME, make_chain(root, 1)[0], root) is None
    assert store.stats["misses"] == 1


def test_expired_is_a_miss(store: Store) -> None:
    root = make_root()
    block = make_chain(root, 1)[0]
    store.put(ACME, make_snapshot(root, block, created_at=1000.0, ttl_s=3600))
    assert store.get(ACME, block, root, now=1000.0 + 3599) is not None
    assert store.get(ACME, block, root, now=1000.0 + 3600) is None
    assert store.stats["expired"] == 1


def test_list_stat_delete(store: Store) -> None:
    root = make_root()
    chain = make_chain(root, 2)
    for b in chain:
        store.put(ACME, make_snapshot(root, b))
    listed = store.list(ACME)
    assert sorted(l.key for l in listed) == sorted(b.key for b in chain)
    kind = store.tiers[0].kind
    assert all(l.tiers == (kind,) and l.size > 0 for l in listed)
    header, tiers = store.stat(ACME, chain[1].key)
    assert header.parent_key == chain[0].key and tiers == [kind]
    assert store.delete(ACME, chain[1].key) == 1
    assert store.stat(ACME, chain[1].key) is None
    assert store.delete(ACME, chain[1].key) == 0


def test_store_urls(tmp_path: Path) -> None:
    tiers = tiers_from_url(f"file://{tmp_path}/a")
    assert [t.kind for t in tiers] == ["nvme"]
    with pytest.raises(ConfigError, match=r"unknown scheme; use file://, s3://"):
        tiers_from_url("gs://bucket")
    with pytest.raises(ConfigError, match="must come first"):
        tiers_from_url(f"s3://bucket,file://{tmp_path}/b")
    with pytest.raises(ConfigError, match="only one file:// tier"):
        tiers_from_url(f"file://{tmp_path}/a,file://{tmp_path}/b")
    with pytest.raises(ConfigError, match="empty"):
        tiers_from_url(" , ")


def test_a_registered_tier_is_found_by_its_scheme(tmp_path: Path, mem_registered) -> None:
    (mem,) = tiers_from_url("mem://a")  # local: no default local tier is put before it
    assert (mem.kind, mem.url, mem.remote) == ("mem", "mem://a", False)
    tiers = tiers_from_url(f"file://{tmp_path}/a,mem://b")
    assert [t.kind for t in tiers] == ["nvme", "mem"]
    with pytest.raises(ConfigError, match="only one mem:// tier"):
        tiers_from_url("mem://a,mem://b")
    with pytest.raises(ConfigError, match=r"use file://, s3://, mem://"):
        tiers_from_url("gs://bucket")
    store = Store.open("mem://c,file://" + str(tmp_path / "c"), parse_config({}))
    root = make_root()
    block = make_chain(root, 1)[0]
    store.put(ACME, make_snapshot(root, block))
    assert [t.kind for t in store.tiers] == ["mem", "nvme"] and store.local is store.tiers[0]
    assert store.probe(ACME, [block], root).count == 1 and store.get(ACME, block, root) is not None


def _rot(tier, name: str) -> None:
    """Replace an object with a damaged copy of itself (a payload byte flipped)."""
    raw = bytearray(tier.read(name).to_pybytes())
    raw[len(raw) // 2] ^= 0xFF
    tier.delete(name)  # a tier that stores encoded snapshots would keep the sound one
    tier.write(name, bytes(raw), expires_at=0)


def test_read_says_why_a_block_is_not_served(store: Store) -> None:
    root = make_root()
    fresh, old, bad, missing = make_chain(root, 4)
    store.put(ACME, make_snapshot(root, fresh, seed=1))
    store.put(ACME, make_snapshot(root, old, created_at=1000.0, ttl_s=3600))
    store.put(ACME, make_snapshot(root, bad))
    tier = store.tiers[0]
    _rot(tier, object_name(ACME.name, bad.key))

    hit = store.read(ACME, fresh, root)
    assert (hit.miss, hit.tier, hit.error) == (None, tier.kind, None)
    assert hit.size == len(tier.read(object_name(ACME.name, fresh.key)))
    assert store.read(ACME, missing, root).miss is MissReason.ABSENT
    assert store.read(ACME, old, root).miss is MissReason.EXPIRED
    rotten = store.read(ACME, bad, root)
    assert rotten.snapshot is None and rotten.miss is MissReason.CORRUPT
    assert isinstance(rotten.error, SnapshotCorrupt)
    assert store.stats["corrupt"] == 1 and store.stats["quarantined"] == 1 and len(tier.quarantined()) == 1


def test_every_bad_copy_is_quarantined_and_counted(tmp_path: Path, mem_registered) -> None:
    store = Store.open(f"file://{tmp_path}/nvme,mem://second", parse_config({}))
    root = make_root()
    block = make_chain(root, 1)[0]
    store.put(ACME, make_snapshot(root, block))
    for tier in store.tiers:
        _rot(tier, object_name(ACME.name, block.key))

    with pytest.raises(SnapshotCorrupt):
        store.get(ACME, block, root)

    assert store.stats["corrupt"] == 2 and store.stats["quarantined"] == 2
    assert [len(t.quarantined()) for t in store.tiers] == [1, 1]
