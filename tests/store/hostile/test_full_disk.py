"""A full disk is an ordinary condition (issue 31, point 5): attacks by a careless operator who lets a
node's disk fill up.

Each test fills a real file system (a small tmpfs, tests/store/hostile/full_fs.py): the kernel's
``ENOSPC`` reaches the snapshot files, the metadata files and SQLite's journal alike. What must hold:
a write that cannot fit raises :class:`store.errors.StoreFull` and leaves no temp file; a read never
fails because its bookkeeping could not be written; the loader starts and serves what is there.
"""
from __future__ import annotations

import time

import pytest

from prefill.cli import main
from store.config import parse_config
from store.errors import StoreFull
from store.serving.loader import KVLoader
from store.tiers.maintenance import gc
from store.tiers.store import Store
from tests.store.factories import ACME, BOLT, make_chain, make_root, make_snapshot
from tests.store.pool_workers import TINY, prompt, synthetic_prefix

BS = 16
SHAPE = dict(layers=2, heads=2, head_dim=16)


def cfg(**store):
    return parse_config({"kv_cache": {"block_size": BS}, "store": store})


def test_attack_disk_nearly_full_makes_put_raise_a_raw_oserror_not_store_full(small_fs):
    fs = small_fs(size=4 << 20)
    store = Store.open(f"file://{fs.path}/store", cfg())
    root = make_root()
    chain = make_chain(root, 3)
    assert store.put(ACME, make_snapshot(root, chain[0]))
    fs.fill(leave=64 << 10)  # small writes (the index) fit; a 260 KB snapshot does not
    big = make_snapshot(root, chain[1], layers=8, heads=8, head_dim=64)

    with pytest.raises(StoreFull, match="nvme_cap") as err:
        store.put(ACME, big)

    assert "free space" in str(err.value)
    assert fs.temp_files() == []
    assert store.read(ACME, chain[0], root).snapshot is not None  # what is there is still served
    fs.free()
    assert store.put(ACME, big)  # nothing of the failed write is left in the way
    store.close()


def test_attack_disk_full_makes_put_raise_sqlite_operational_error_not_store_full(small_fs):
    fs = small_fs(size=2 << 20)
    url = f"file://{fs.path}/store"
    root = make_root()
    chain = make_chain(root, 4)
    first = Store.open(url, cfg())
    assert first.put(ACME, make_snapshot(root, chain[0]))
    fs.fill()

    with pytest.raises(StoreFull, match="free space"):  # the index's transaction cannot be written
        first.put(ACME, make_snapshot(root, chain[1]))
    first.close()
    again = Store.open(url, cfg())  # a process opening the store on the full disk
    with pytest.raises(StoreFull, match="nvme_cap"):
        again.put(ACME, make_snapshot(root, chain[2]))

    assert again.read(ACME, chain[0], root).snapshot is not None
    assert fs.temp_files() == []
    again.close()


def test_attack_prefill_warm_on_a_full_store_ends_in_a_traceback_and_leaves_temp_files(small_fs, tmp_path, capsys,
                                                                                       monkeypatch):
    fs = small_fs(size=4 << 20)
    config = tmp_path / "kvwarm.yaml"
    config.write_text("tenants:\n  acme:\n    secret_env: KVWARM_TEST_ACME_SECRET\n")
    monkeypatch.setenv("KVWARM_TEST_ACME_SECRET", "acme-secret-of-a-decent-length-0123456789abcdef")
    warm = ["warm", "--config", str(config), "--store", f"file://{fs.path}/store", "--block-size", str(BS)]
    text = "You are a meticulous travel planner. Ask for dates, budget and interests before proposing anything."
    assert main([*warm, "--tenant", "public", "--text", text]) == 0
    capsys.readouterr()
    fs.fill()

    # a tenant new to this store: its owner record is written first, then its snapshots
    rc = main([*warm, "--tenant", "acme", "--text", text])

    err = capsys.readouterr().err
    assert rc == 1
    assert "StoreFull" in err and "nvme_cap" in err and "free space" in err
    assert "Traceback" not in err and "rerun once there is room" in err
    assert fs.temp_files() == []


def test_attack_full_disk_with_recency_flush_0_turns_every_lookup_into_an_error_miss(small_fs, tmp_path):
    fs = small_fs(size=4 << 20)
    config = cfg(recency_flush_s=0)
    url = f"file://{fs.path}/nvme"
    ids = prompt(3 * BS + 1, seed=51)
    writer = Store.open(url, config)
    synthetic_prefix(writer, config, ids[: 3 * BS], **SHAPE)
    writer.close()
    loader = KVLoader(url, tenant=ACME, model=TINY, config=config, pool_bytes=1 << 30, pool_dir=tmp_path / "pool")
    fs.fill()

    for _ in range(3):  # every read writes its access record (recency_flush_s 0): none of them can
        hit, reason = loader.lookup_with_reason(ids)
        assert hit is not None and len(hit.blocks) == 3 and reason is None
        hit.release()

    stats = loader.stats()
    assert stats["misses_by_reason"] == {} and stats["hits"] == 3
    assert stats["bookkeeping_unwritten"] >= 1  # counted, not failed
    loader.close()


def test_attack_pool_file_system_full_makes_kvloader_raise(small_fs, tmp_path):
    pool_fs = small_fs("pool", size=1 << 20)
    config = cfg()
    url = f"file://{tmp_path}/nvme"
    ids = prompt(2 * BS + 1, seed=52)
    writer = Store.open(url, config)
    synthetic_prefix(writer, config, ids[: 2 * BS], **SHAPE)
    writer.close()
    pool_fs.fill()

    loader = KVLoader(url, tenant=ACME, model=TINY, config=config, pool_bytes=1 << 30, pool_dir=pool_fs.path / "pool")

    hit, reason = loader.lookup_with_reason(ids)
    assert hit is not None and len(hit.blocks) == 2 and reason is None  # served what is there
    hit.release()
    assert loader.stats()["pool_private"] is True  # the node's shared pool could not be written
    loader.close()


# -- what else a full disk must leave working ------------------------------------------------------

def test_a_new_namespace_on_a_full_disk_is_store_full_and_its_owner_record_leaves_no_temp_file(small_fs):
    fs = small_fs(size=2 << 20)
    store = Store.open(f"file://{fs.path}/store", cfg())
    acme, bolt = make_root(ACME), make_root(BOLT)
    assert store.put(ACME, make_snapshot(acme, make_chain(acme, 1)[0]))
    fs.fill()

    with pytest.raises(StoreFull, match="tenants/bolt.json"):  # the owner record is the first write
        store.put(BOLT, make_snapshot(bolt, make_chain(bolt, 1)[0], tenant=BOLT))

    assert fs.temp_files() == [] and store.local.get_meta("tenants/bolt.json") is None
    store.close()


def test_gc_on_a_full_disk_removes_what_expired_then_catches_the_index_up(small_fs, caplog):
    fs = small_fs(size=2 << 20)
    store = Store.open(f"file://{fs.path}/store", cfg())
    root = make_root()
    chain = make_chain(root, 10)
    old = time.time() - 7200
    for b in chain[:8]:  # 8 expired snapshots of 33 KB: the room GC can make
        store.put(ACME, make_snapshot(root, b, created_at=old, ttl_s=60, layers=4, heads=4, head_dim=64))
    for b in chain[8:]:
        store.put(ACME, make_snapshot(root, b))
    store.close()
    fs.fill()
    store = Store.open(f"file://{fs.path}/store", cfg())  # GC's own process, on the full disk

    report = gc(store)

    assert "GC removes expired snapshots by their headers" in caplog.text  # the index could not be written
    tier = store.local
    assert sorted(e.name.rsplit("/", 1)[-1][:-4] for e in tier.entries()) == sorted(b.key for b in chain[8:])
    assert report.expired_removed == 8 and report.index_fixes["dropped"] == 8
    assert tier.usage() == sum(e.size for e in tier.entries())  # the index agrees with the files again
    store.close()


def test_a_pool_whose_file_system_fills_while_serving_goes_private_and_keeps_serving(small_fs, tmp_path):
    pool_fs = small_fs("pool", size=1 << 20)
    config = cfg()
    url = f"file://{tmp_path}/nvme"
    first, second = prompt(2 * BS + 1, seed=53), prompt(2 * BS + 1, seed=54)
    writer = Store.open(url, config)
    for ids in (first, second):
        synthetic_prefix(writer, config, ids[: 2 * BS], **SHAPE)
    writer.close()
    loader = KVLoader(url, tenant=ACME, model=TINY, config=config, pool_bytes=1 << 30, pool_dir=pool_fs.path / "pool")
    hit = loader.lookup(first)
    assert hit is not None and loader.stats()["pool_private"] is False
    hit.release()
    pool_fs.fill()

    for ids in (second, first):  # new admissions, then a chain this process mapped in the node's pool
        hit, reason = loader.lookup_with_reason(ids)
        assert hit is not None and len(hit.blocks) == 2 and reason is None
        hit.release()

    stats = loader.stats()
    assert stats["pool_private"] is True and stats["misses_by_reason"] == {}
    assert stats["pool_bytes_in_use"] > 0  # the private pool holds what was admitted after the switch
    loader.close()


def test_a_loader_started_on_a_full_nvme_disk_serves_what_is_there(small_fs, tmp_path):
    fs = small_fs(size=2 << 20)
    config = cfg()
    url = f"file://{fs.path}/nvme"
    ids = prompt(2 * BS + 1, seed=55)
    writer = Store.open(url, config)
    synthetic_prefix(writer, config, ids[: 2 * BS], **SHAPE)
    writer.close()  # no process holds the index open: a new one must open it on the full disk
    fs.fill()

    loader = KVLoader(url, tenant=ACME, model=TINY, config=config, pool_bytes=1 << 30, pool_dir=tmp_path / "pool")
    hit, reason = loader.lookup_with_reason(ids)

    assert hit is not None and len(hit.blocks) == 2 and reason is None
    hit.release()
    loader.close()
