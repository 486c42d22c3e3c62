"""Damaged or misplaced snapshot files on the NVMe tier: detected on read (and by
verify without a read), quarantined with a reason, counted, and never returned."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pytest

from store.errors import SnapshotCorrupt, SnapshotError, SnapshotMismatch
from store.format.snapshot import Snapshot, read_snapshot
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.maintenance import check_object, verify
from store.tiers.store import Store
from tests.store.factories import ACME, BOLT, make_chain, make_root, make_snapshot


class Clock:
    """Each reading one second later: quarantined copies get distinct names."""

    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
def env(tmp_path: Path):
    tier = LocalTier(tmp_path / "nvme", cap_bytes=1 << 30, clock=Clock())
    store = Store([tier])
    root = make_root()
    chain = make_chain(root, 4)
    snaps = [make_snapshot(root, b, seed=i, ttl_s=10**9) for i, b in enumerate(chain)]
    for s in snaps:
        assert store.put(ACME, s)
    yield store, tier, root, chain, snaps
    store.close()


def _path(tier: LocalTier, block) -> Path:
    return tier.path(object_name("acme", block.key))


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


# Each damage takes (tier, chain, snaps) and damages block 1's file in place.
def _flip_header_read_copy(tier, chain, snaps) -> None:
    """The header copy readers use: the schema in the footer (the last occurrence)."""
    path = _path(tier, chain[1])
    data = path.read_bytes()
    at = data.rfind(b'"model_fingerprint"')
    assert at > len(data) // 2, "the footer copy of the header should be near the end"
    _flip(path, at + len(b'"model_fingerprint":"') + 2)


def _flip_payload(tier, chain, snaps) -> None:
    """A byte inside the stored FP8 bytes of part ``k.0``."""
    path = _path(tier, chain[1])
    data = path.read_bytes()
    part = bytes(snaps[1].buffers[0])
    at = data.find(part)
    assert at > 0 and data.find(part, at + 1) < 0, "part bytes should occur once"
    _flip(path, at + len(part) // 2, 0x40)


def _truncate(tier, chain, snaps) -> None:
    path = _path(tier, chain[1])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _copy_under_other_key(tier, chain, snaps) -> None:
    """Block 0's (intact) file put at block 1's path in the same tenant directory."""
    shutil.copyfile(_path(tier, chain[0]), _path(tier, chain[1]))


DAMAGES: dict[str, tuple[Callable, type[SnapshotError], str]] = {
    "header-byte": (_flip_header_read_copy, SnapshotCorrupt, "corrupt"),
    "payload-byte": (_flip_payload, SnapshotCorrupt, "corrupt"),
    "truncated": (_truncate, SnapshotCorrupt, "corrupt"),
    "copied-under-other-key": (_copy_under_other_key, SnapshotMismatch, "mismatched"),
}


def _assert_quarantined(tier: LocalTier, name: str) -> dict:
    assert not tier.path(name).exists(), "the bad file must leave objects/"
    quarantined = list(tier.quarantine_dir.glob(f"{name.replace('/', '__')}.*.kvw"))
    assert len(quarantined) == 1, list(tier.quarantine_dir.iterdir())
    note = json.loads(quarantined[0].with_suffix(".reason.json").read_text())
    assert note["name"] == name
    assert note["reason"]
    return note


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damage_is_detected_on_get_quarantined_counted_and_never_returned(env, damage: str) -> None:
    store, tier, root, chain, snaps = env
    plant, error, counter = DAMAGES[damage]
    name = object_name("acme", chain[1].key)
    plant(tier, chain, snaps)

    with pytest.raises(error):
        store.get(ACME, chain[1], root)
    note = _assert_quarantined(tier, name)
    assert note["reason"].startswith(error.__name__)
    assert store.stats[counter] == 1
    assert store.stats["quarantined"] == 1
    assert store.stats["hits"] == 0

    # Never returned: now a plain miss; the index no longer counts it; neighbours intact.
    assert store.get(ACME, chain[1], root) is None
    assert tier.usage() == tier.disk_usage()
    for i in (0, 2, 3):
        snap = store.get(ACME, chain[i], root)
        assert snap is not None and snap.header.key == chain[i].key
        snap.close()
    # A new prefill of the block heals it.
    assert store.put(ACME, snaps[1])
    assert check_object(tier, name) is None


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_verify_finds_damage_without_a_read(env, damage: str) -> None:
    store, tier, root, chain, snaps = env
    plant, error, _ = DAMAGES[damage]
    name = object_name("acme", chain[1].key)
    plant(tier, chain, snaps)
    assert check_object(tier, name) is not None

    report = verify(store)
    assert report.checked == 4 and report.ok == 3
    assert len(report.bad) == 1 and report.bad[0][0].endswith(name)
    assert report.bad[0][1].startswith(error.__name__)
    assert len(report.quarantined) == 1
    _assert_quarantined(tier, name)
    assert store.stats["corrupt"] == 1 and store.stats["quarantined"] == 1
    assert verify(store).clean
    assert store.get(ACME, chain[1], root) is None


def test_a_flipped_byte_in_the_leading_header_copy_is_harmless_on_read_and_caught_by_verify(env) -> None:
    """An Arrow IPC file carries the schema (and so the header) twice. Readers parse the
    footer copy; a damaged leading copy cannot change what they get, and the full check
    (verify, GC) catches it."""
    store, tier, root, chain, snaps = env
    path = _path(tier, chain[1])
    original = _parts(read_snapshot(pa.py_buffer(path.read_bytes())))
    data = path.read_bytes()
    at = data.find(b'"model_fingerprint"')
    assert at < len(data) // 2
    _flip(path, at + len(b'"model_fingerprint":"') + 2)

    snap = store.get(ACME, chain[1], root)
    assert snap is not None and _parts(snap) == original
    snap.close()
    report = verify(store)
    assert len(report.bad) == 1 and "two header copies" in report.bad[0][1]
    _assert_quarantined(tier, object_name("acme", chain[1].key))


@pytest.mark.parametrize("keep", [0, 1, 8, 16, 100, -10, -1])
def test_truncation_at_any_length_is_corrupt(env, keep: int) -> None:
    store, tier, root, chain, snaps = env
    path = _path(tier, chain[2])
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(SnapshotCorrupt):
        store.get(ACME, chain[2], root)
    assert store.stats["corrupt"] == 1 and store.stats["quarantined"] == 1
    assert store.get(ACME, chain[2], root) is None


def test_a_snapshot_copied_into_another_tenants_directory_is_refused(env) -> None:
    store, tier, root, chain, snaps = env
    bolt_root = make_root(BOLT)
    bolt_block = make_chain(bolt_root, 1)[0]
    store.put(BOLT, make_snapshot(bolt_root, bolt_block, tenant=BOLT))
    bolt_path = tier.path(object_name("bolt", bolt_block.key))
    shutil.copyfile(_path(tier, chain[0]), bolt_path)  # ACME's KV under BOLT's name

    with pytest.raises(SnapshotMismatch):
        store.get(BOLT, bolt_block, bolt_root)
    assert store.stats["mismatched"] == 1 and store.stats["quarantined"] == 1
    assert not bolt_path.exists()


# -- property: one flipped byte anywhere never yields wrong KV ------------------------
def _parts(snap: Snapshot) -> tuple:
    return (snap.header, {p.name: snap.array(p.name).tobytes() for p in snap.header.parts})


def test_a_random_flipped_byte_never_yields_wrong_kv(env) -> None:
    store, tier, root, chain, snaps = env
    path = _path(tier, chain[3])
    original = path.read_bytes()
    expected = _parts(read_snapshot(pa.py_buffer(original)))
    rng = random.Random(1234)
    outcomes = {"refused": 0, "identical": 0}
    for trial in range(200):
        offset = rng.randrange(len(original))
        mask = rng.randrange(1, 256)
        damaged = bytearray(original)
        damaged[offset] ^= mask
        path.write_bytes(bytes(damaged))
        try:
            snap = store.get(ACME, chain[3], root)
        except SnapshotError:
            outcomes["refused"] += 1
            assert not path.exists(), "a refused file is quarantined"
            continue
        assert snap is not None, f"offset {offset}: a damaged file was neither refused nor served"
        assert _parts(snap) == expected, f"offset {offset} mask {mask:#x}: served KV differs from what was written"
        snap.close()
        outcomes["identical"] += 1
    assert outcomes["refused"] > 50 and outcomes["identical"] > 0, outcomes
    assert store.stats["corrupt"] + store.stats["mismatched"] == outcomes["refused"]
    assert store.stats["quarantined"] == outcomes["refused"]


def _sweep(data: bytes, offsets, masks=(0x01, 0x80)) -> dict[str, list]:
    """Read ``data`` with one byte flipped at each offset (in memory, full checks on)."""
    expected = _parts(read_snapshot(pa.py_buffer(data)))
    out: dict[str, list] = {"refused": [], "identical": [], "WRONG": [], "other_error": []}
    for offset in offsets:
        for mask in masks:
            damaged = bytearray(data)
            damaged[offset] ^= mask
            try:
                snap = read_snapshot(pa.py_buffer(bytes(damaged)))
            except SnapshotError:
                out["refused"].append(offset)
                continue
            except Exception as exc:  # not a typed refusal: see the test below
                out["other_error"].append((offset, mask, f"{type(exc).__name__}: {exc}"))
                continue
            out["identical" if _parts(snap) == expected else "WRONG"].append((offset, mask))
    return out


def test_no_single_byte_flip_anywhere_yields_wrong_kv(env) -> None:
    """Exhaustive over every offset of a small snapshot: a flip is refused or harmless."""
    store, tier, root, chain, snaps = env
    data = _path(tier, chain[0]).read_bytes()
    result = _sweep(data, range(len(data)))
    assert result["WRONG"] == []
    assert len(result["refused"]) > len(data) // 2


def test_every_damaged_file_is_refused_with_a_snapshot_error(env) -> None:
    store, tier, root, chain, snaps = env
    data = _path(tier, chain[0]).read_bytes()
    result = _sweep(data, range(len(data)))
    assert result["other_error"] == []


def test_store_get_of_a_file_with_a_damaged_footer_raises_a_store_error(env) -> None:
    store, tier, root, chain, snaps = env
    path = _path(tier, chain[0])
    # A bit of the footer's schema (the payload column's integer width): the file ends
    # with the footer, its 4-byte length and the 6-byte magic "ARROW1".
    _flip(path, path.stat().st_size - 14, 0x01)
    with pytest.raises(SnapshotError):
        store.get(ACME, chain[0], root)
    assert not path.exists() and store.stats["quarantined"] == 1


def test_verify_survives_a_file_with_a_damaged_footer(env) -> None:
    store, tier, root, chain, snaps = env
    path = _path(tier, chain[0])
    _flip(path, path.stat().st_size - 14, 0x01)
    report = verify(store)
    assert len(report.bad) == 1 and report.ok == 3


def test_a_tier_with_a_damaged_file_reopens_on_a_fresh_index(env) -> None:
    store, tier, root, chain, snaps = env
    path = _path(tier, chain[0])
    _flip(path, path.stat().st_size - 14, 0x01)
    store.close()
    for suffix in ("", "-wal", "-shm"):
        (tier.root / "meta" / f"index.sqlite{suffix}").unlink(missing_ok=True)
    reopened = LocalTier(tier.root, cap_bytes=1 << 30)
    assert reopened.usage() == reopened.disk_usage()


def test_quarantining_a_key_twice_at_one_instant_keeps_both_files(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "nvme", cap_bytes=1 << 30, clock=lambda: 1_700_000_000.0)
    store = Store([tier])
    root = make_root()
    block = make_chain(root, 1)[0]
    for seed in (1, 2):
        store.put(ACME, make_snapshot(root, block, seed=seed, ttl_s=10**9))
        path = tier.path(object_name("acme", block.key))
        path.write_bytes(path.read_bytes()[:100])
        with pytest.raises(SnapshotCorrupt):
            store.get(ACME, block, root)
    assert store.stats["quarantined"] == 2
    assert len(tier.quarantined()) == 2
