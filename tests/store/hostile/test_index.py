"""Damaged SQLite indexes: the local tier's (``meta/index.sqlite``) and the node pool's (issue 31, point 4).

Neither holds anything the snapshot files do not also tell (the pool holds only what is mapped
now), so neither may make a reader raise: a damaged file is set aside and the index rebuilt
from the files, rows out of type or bounds are dropped (and their files indexed again), and
the read proceeds. ``prefill store verify`` names what was repaired. Before the fix each of
these made opening the store, a lookup, a write or GC raise, or broke an invariant of the cap,
the expiry or the store's own directory.
"""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
import torch

from prefill.cli import main
from store.format.encode import EncodedSnapshot, build_snapshot
from store.identity.keys import Block, block_chain
from store.serving.loader import KVLoader
from store.tiers.local import LocalTier
from store.tiers.maintenance import gc
from store.tiers.store import Store
from tests.store.pool_workers import ACME, TINY, config, prompt

BS = 16
CFG = config(BS, "fp8")
PRECISION = CFG.kv_cache.precision()
ROOT = TINY.key_root(PRECISION, BS, ACME.salt)
IDS = prompt(3 * BS + 1, seed=7)
CHAIN = block_chain(ROOT, IDS[: 3 * BS])


def _snapshot(block: Block, *, seed: int = 0, created_at: float | None = None, ttl_s: float = 3600) -> EncodedSnapshot:
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(2, BS, 16, generator=g), torch.randn(2, BS, 16, generator=g)) for _ in range(2)]
    return build_snapshot(root=ROOT, block=block, tenant=ACME.name, kv=kv, precision=PRECISION,
                          created_at=time.time() if created_at is None else created_at, ttl_s=ttl_s)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A store holding the first two blocks of ``CHAIN``, closed (its index checkpointed into one file)."""
    store = Store.open(f"file://{tmp_path / 'nvme'}", CFG)
    for i, block in enumerate(CHAIN[:2]):
        assert store.put(ACME, _snapshot(block, seed=i))
    store.close()
    return tmp_path / "nvme"


def _index(root: Path) -> Path:
    return root / "meta" / "index.sqlite"


def _rows(root: Path, *rows: tuple) -> None:
    with sqlite3.connect(_index(root)) as db:
        db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)", rows)
    sqlite3.connect(_index(root)).close()


def _name(block: Block) -> str:
    return f"acme/{block.key[:2]}/{block.key}.kvw"


def _serves_and_writes(tmp_path: Path, root: Path) -> KVLoader:
    """What a node does with the store: open it, look a prompt up (every stored block is a hit),
    write the next block, collect garbage; the index then agrees with the files."""
    loader = KVLoader(f"file://{root}", tenant=ACME, model=TINY, config=CFG, pool_bytes=1 << 30,
                      pool_dir=tmp_path / "pool")
    hit, reason = loader.lookup_with_reason(IDS)
    assert hit is not None and len(hit.blocks) == 2 and reason is None
    hit.release()
    assert loader.store.put(ACME, _snapshot(CHAIN[2], seed=2))
    gc(loader.store)
    tier = loader.local
    assert tier.usage() == tier.disk_usage() > 0 and tier.index.count() == 3
    return loader


def _verify(tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text(f"kv_cache:\n  block_size: {BS}\n")
    code = main(["store", "--config", str(cfg), "--store", f"file://{root}", "verify", "--no-quarantine"])
    return code, capsys.readouterr().out


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x89not a database\x00" * 512)


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:4096 * 2])  # the schema page and one more: the rest is gone


@pytest.mark.parametrize("damage", [_garbage, _truncated])
def test_attack_index_file_of_garbage_bytes_is_set_aside_and_rebuilt(tmp_path, store_dir, capsys, damage) -> None:
    damage(_index(store_dir))

    loader = _serves_and_writes(tmp_path, store_dir)
    fix = loader.local.index.repair
    assert fix is not None and fix.set_aside is not None and Path(fix.set_aside).is_file()
    loader.close()
    damage(_index(store_dir))
    code, out = _verify(tmp_path, store_dir, capsys)
    assert code == 1 and "index.sqlite" in out and "set aside" in out


@pytest.mark.parametrize("schema", [
    "CREATE TABLE entries (name TEXT PRIMARY KEY, size INTEGER)",  # another version's columns
    # the right table, and a trigger that refuses every write (writers raised IntegrityError)
    "CREATE TRIGGER no_writes BEFORE INSERT ON entries BEGIN SELECT RAISE(ABORT, 'no'); END",
])
def test_attack_index_with_a_wrong_schema_is_set_aside_and_rebuilt(tmp_path, store_dir, capsys, schema) -> None:
    with sqlite3.connect(_index(store_dir)) as db:
        if schema.startswith("CREATE TABLE"):
            db.execute("DROP TABLE entries")
        db.execute(schema)
    sqlite3.connect(_index(store_dir)).close()

    loader = _serves_and_writes(tmp_path, store_dir)
    assert loader.local.index.repair is not None and "schema" in loader.local.index.repair.reason
    loader.close()


def test_attack_index_rows_with_wrong_types_are_dropped_and_their_files_indexed_again(tmp_path, store_dir,
                                                                                     capsys) -> None:
    with sqlite3.connect(_index(store_dir)) as db:
        db.execute("UPDATE entries SET size = 'a lot' WHERE name = ?", (_name(CHAIN[0]),))  # summed, subtracted
        db.execute("UPDATE entries SET state = 'pending', pid = 'x' WHERE name = ?", (_name(CHAIN[1]),))  # kill('x')
    sqlite3.connect(_index(store_dir)).close()
    _rows(store_dir, (7, 1, 0.0, 0.0, "ready", 0))  # a name that is no name

    code, out = _verify(tmp_path, store_dir, capsys)
    assert code == 1 and "3 row(s) held values out of type or bounds" in out
    loader = _serves_and_writes(tmp_path, store_dir)
    loader.close()


@pytest.mark.parametrize("sizes", [(-(1 << 40),), ((1 << 62), (1 << 62))])
def test_attack_index_rows_with_negative_or_huge_sizes_are_dropped(tmp_path, store_dir, sizes) -> None:
    # a negative size hid bytes from the cap; two huge ones overflowed its sum (OperationalError on every write)
    with sqlite3.connect(_index(store_dir)) as db:
        db.executemany("UPDATE entries SET size = ? WHERE name = ?",
                       [(size, _name(block)) for size, block in zip(sizes, CHAIN)])
    sqlite3.connect(_index(store_dir)).close()

    loader = _serves_and_writes(tmp_path, store_dir)
    assert loader.local.index.repair.rows_dropped == len(sizes)
    loader.close()


def _null_expiry(root: Path, name: str) -> None:
    """What a NaN expiry is in SQLite (it stores NaN as NULL), written past the NOT NULL constraint
    as a damaged or hand-edited file holds it, the schema's text left as this version writes it."""
    db = sqlite3.connect(_index(root), isolation_level=None)
    sql = db.execute("SELECT sql FROM sqlite_master WHERE name = 'entries'").fetchone()[0]
    db.execute("PRAGMA writable_schema = ON")
    db.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'entries'", (sql.replace("expires REAL NOT NULL",
                                                                                         "expires REAL"),))
    db.close()
    db = sqlite3.connect(_index(root), isolation_level=None)
    db.execute("UPDATE entries SET expires = ? WHERE name = ?", (float("nan"), name))
    db.execute("PRAGMA writable_schema = ON")
    db.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'entries'", (sql,))
    db.close()


@pytest.mark.parametrize("expiry", ["inf", "nan"])
def test_attack_index_rows_with_nan_or_infinite_times_are_dropped_and_expiry_read_from_the_file(
        tmp_path, store_dir, expiry) -> None:
    store = Store.open(f"file://{store_dir}", CFG)
    old = _snapshot(block_chain(ROOT, prompt(BS, seed=8))[0], created_at=time.time() - 7200, ttl_s=60)
    assert store.put(ACME, old)  # expired an hour ago
    store.close()
    name = _name(old.header)  # type: ignore[arg-type]
    if expiry == "inf":
        with sqlite3.connect(_index(store_dir)) as db:
            db.execute("UPDATE entries SET expires = 1e999, last_access = -1e999 WHERE name = ?", (name,))
    else:
        _null_expiry(store_dir, name)

    store = Store.open(f"file://{store_dir}", CFG)
    report = gc(store)  # the header says it expired: it goes (an infinite or missing expiry kept it forever)
    assert report.expired_removed == 1 and not store.local.path(name).exists()
    fix = store.local.index.repair  # an infinite time is a row out of bounds; a NULL one in a NOT NULL
    assert fix.rows_dropped == 1 if expiry == "inf" else fix.set_aside  # column fails SQLite's own check
    store.close()


def test_attack_index_row_naming_a_file_outside_the_store_deletes_nothing(tmp_path, store_dir) -> None:
    victim = tmp_path / "victim.kvw"
    victim.write_text("an operator's file")
    # expired, so first to go when a write makes room: the tier unlinked objects/<name>
    _rows(store_dir, ("../../victim.kvw", 1, 0.0, 0.0, "ready", 0))
    size = (store_dir / "objects" / _name(CHAIN[0])).stat().st_size
    tier = LocalTier(store_dir, cap_bytes=size * 5 // 2)  # room for two: the third write evicts
    store = Store([tier])

    assert store.put(ACME, _snapshot(CHAIN[2], seed=2))
    assert victim.read_text() == "an operator's file"
    assert tier.usage() == tier.disk_usage() <= tier.cap_bytes
    store.close()


def _pool_rows(pool: Path) -> None:
    with sqlite3.connect(pool / "pool.sqlite") as db:
        db.execute("INSERT INTO entries VALUES ('acme/00/x.kvw', '/dev/null', 'huge', 0, 0, 0, 1)")
        db.execute("INSERT INTO pins VALUES ('acme/00/x.kvw', 'x', 1)")  # kill('x') on every attach
        db.execute("UPDATE meta SET v = 'many' WHERE k = 'epoch'")


@pytest.mark.parametrize("damage", ["garbage", "rows"])
def test_attack_damaged_pool_index_is_rebuilt_and_lookups_hit(tmp_path, store_dir, damage) -> None:
    first = KVLoader(f"file://{store_dir}", tenant=ACME, model=TINY, config=CFG, pool_bytes=1 << 30,
                     pool_dir=tmp_path / "pool")
    assert len(first.lookup(IDS).blocks) == 2
    first.close()
    if damage == "garbage":
        for f in (tmp_path / "pool").glob("pool.sqlite*"):
            f.unlink()
        _garbage(tmp_path / "pool" / "pool.sqlite")
    else:
        _pool_rows(tmp_path / "pool")

    loader = _serves_and_writes(tmp_path, store_dir)
    assert loader.pool.repair is not None and loader.pool.attached
    assert loader.stats()["misses_by_reason"] == {}
    loader.close()
