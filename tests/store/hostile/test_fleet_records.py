"""Issue 31, fleet records: a hostile or damaged fleet file never ranks and never costs more than
its capped size; a tenant's fleet file says nothing of another tenant's volume.

Each test plants a file of node ``evil`` beside a good record written by a real recorder, in a
real local tier, and reads them back as every serving node does (:func:`read_fleet`).
"""
from __future__ import annotations

import json
import math
import secrets
import tracemalloc

from store.serving.fleet import FleetRecorder, read_fleet
from store.serving.fleet_file import FORMAT
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.stats import StoreStats

T0 = 1_700_000_000.0
#: the default fleet_memory.max_file_bytes
CAP = 8 << 20


def good_tier(tmp_path) -> tuple[LocalTier, list[str]]:
    """A tier holding node-a's honest record of two acme blocks, used at T0."""
    tier = LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)
    served = [object_name("acme", secrets.token_hex(32)) for _ in range(2)]
    rec = FleetRecorder([tier], "node-a", clock=lambda: T0)
    rec.record(served, now=T0)
    rec.flush(now=T0 + 1)
    return tier, served


def plant(tier: LocalTier, *, n: int = 1, **changes) -> list[str]:
    """node ``evil``'s record of ``n`` acme keys, with ``changes`` to its fields or columns; its names."""
    keys = [secrets.token_hex(32) for _ in range(n)]
    doc = {"format": FORMAT, "namespace": "acme", "node": "evil", "written_at": T0 + 2, "traffic": 10,
           "window_s": 3600.0, "keys": keys, "age_s": [0.0] * n, "uses": [1] * n, "traffic_age": [0] * n}
    doc.update(changes)
    tier.put_meta("fleet/acme/evil.json", json.dumps(doc, separators=(",", ":")).encode())
    return [object_name("acme", k) for k in keys]


def read(tier: LocalTier) -> tuple[list, StoreStats]:
    stats = StoreStats()
    return read_fleet([tier], ["acme"], since=0, stats=stats), stats


def assert_skipped(tier: LocalTier, evil: list[str], served: list[str]) -> None:
    uses, stats = read(tier)
    assert not {u.name for u in uses} & set(evil), "a hostile record was used"
    assert [u.name for u in uses] == served, "the honest record must still be read"
    assert stats["corrupt"] == 1


def test_attack_written_at_1e300_never_ranks(tmp_path):
    tier, served = good_tier(tmp_path)
    evil = plant(tier, written_at=1e300)
    assert_skipped(tier, evil, served)


def test_attack_nan_times_never_rank(tmp_path):
    tier, served = good_tier(tmp_path)
    evil = plant(tier, n=2, written_at=math.nan)
    assert_skipped(tier, evil, served)
    evil = plant(tier, n=2, age_s=[math.nan, math.inf])
    assert_skipped(tier, evil, served)


def test_attack_negative_age_never_ranks(tmp_path):
    tier, served = good_tier(tmp_path)
    evil = plant(tier, age_s=[-1e9])  # "used" 30 years after it was written
    assert_skipped(tier, evil, served)
    evil = plant(tier, traffic_age=[-5])
    assert_skipped(tier, evil, served)


def test_attack_uses_10_to_the_12_never_ranks(tmp_path):
    tier, served = good_tier(tmp_path)
    evil = plant(tier, uses=[10**12])
    assert_skipped(tier, evil, served)


def test_attack_uses_true_never_ranks(tmp_path):
    tier, served = good_tier(tmp_path)
    evil = plant(tier, uses=[True])
    assert_skipped(tier, evil, served)


def test_attack_oversize_file_is_skipped_without_being_read(tmp_path):
    tier, served = good_tier(tmp_path)
    n = CAP // 75 + 100  # 75 bytes an entry: just over the cap, otherwise a valid record
    evil = plant(tier, n=n, traffic=n)
    size = (tier.root / "meta" / "fleet" / "acme" / "evil.json").stat().st_size
    assert CAP < size < CAP + (16 << 10)

    tracemalloc.start()
    try:
        uses, stats = read(tier)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert not {u.name for u in uses} & set(evil)
    assert [u.name for u in uses] == served and stats["corrupt"] == 1
    assert peak < size // 8, f"reading past an oversize file allocated {peak} bytes"


def test_attack_node_wide_counter_leaks_another_tenants_volume_is_closed(tmp_path):
    tier = LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)
    rec = FleetRecorder([tier], "node-1", clock=lambda: T0)
    acme = object_name("acme", secrets.token_hex(32))
    rec.record([acme], now=T0)
    for i in range(100):  # beta's volume: none of acme's business
        rec.record([object_name("beta", secrets.token_hex(32))], now=T0 + 1 + i * 0.01)
    rec.flush(now=T0 + 5)

    doc = json.loads(tier.get_meta("fleet/acme/node-1.json"))
    assert doc["traffic"] == 1 and doc["traffic_age"] == [0] and doc["uses"] == [1]
    [use] = read_fleet([tier], ["acme"], since=0)
    assert (use.name, use.traffic, use.traffic_age) == (acme, 1, 0)
    assert json.loads(tier.get_meta("fleet/beta/node-1.json"))["traffic"] == 100
