"""The Tier contract, run against every tier (local, the toy in-memory tier, S3 on moto and on SeaweedFS).

Each tier is built from its URL through the registry (``tier_case`` in conftest.py), and
each capability a tier claims is checked to hold (and one it does not claim, to refuse).
"""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest

from store.errors import StoreRecordInvalid
from store.format.encode import snapshot_bytes
from store.format.snapshot import read_snapshot
from store.tiers.base import object_name
from tests.store.factories import ACME, BOLT, make_chain, make_root, make_snapshot


@pytest.fixture
def tier(tier_case):
    return tier_case.tier


def acme_chain(n: int = 4):
    root = make_root(ACME)
    chain = make_chain(root, n)
    return root, chain, [object_name(ACME.name, b.key) for b in chain]


def test_write_read_round_trip_of_a_real_snapshot(tier):
    root, chain, names = acme_chain(1)
    snap = make_snapshot(root, chain[0], seed=7)

    assert tier.write(names[0], snap, expires_at=snap.header.expires_at) is True
    buf = tier.read(names[0])

    assert isinstance(buf, pa.Buffer)
    assert buf.to_pybytes() == snapshot_bytes(snap)
    back = read_snapshot(buf, location=tier.describe(names[0]), full=True)
    assert back.header == snap.header
    for part, raw in zip(snap.header.parts, snap.buffers):
        assert np.array_equal(back.array(part.name), raw)
    back.header.check_matches(chain[0], root)
    assert tier.read(names[0], readahead=True).to_pybytes() == snapshot_bytes(snap)


def test_write_accepts_plain_bytes(tier):
    root, chain, names = acme_chain(1)
    raw = snapshot_bytes(make_snapshot(root, chain[0]))
    tier.write(names[0], pa.py_buffer(raw), expires_at=0)
    assert tier.read(names[0]).to_pybytes() == raw


def test_a_second_write_of_an_object_keeps_it(tier):
    root, chain, names = acme_chain(1)
    snap = make_snapshot(root, chain[0], seed=1)
    tier.write(names[0], snap, expires_at=snap.header.expires_at)

    again = tier.write(names[0], snap, expires_at=snap.header.expires_at)

    # a tier that takes encoded snapshots skips what it holds; the others may rewrite the same bytes
    assert again is (not tier.stores_encoded)
    assert tier.read(names[0]).to_pybytes() == snapshot_bytes(snap)


def test_read_of_a_missing_object_is_none(tier):
    _, _, names = acme_chain(1)
    assert tier.read(names[0]) is None


def test_exists(tier):
    root, chain, names = acme_chain(2)
    tier.write(names[0], make_snapshot(root, chain[0]), expires_at=0)
    assert tier.exists(names[0]) is True
    assert tier.exists(names[1]) is False


def test_probe_counts_leading_existing_names_only(tier):
    root, chain, names = acme_chain(5)
    for i in (0, 1, 3, 4):  # a gap at 2
        tier.write(names[i], make_snapshot(root, chain[i]), expires_at=0)

    assert tier.probe(names) == 2
    assert tier.probe(names[:2]) == 2
    assert tier.probe(names[3:]) == 2
    assert tier.probe(names[2:]) == 0
    assert tier.probe([]) == 0
    tier.write(names[2], make_snapshot(root, chain[2]), expires_at=0)
    assert tier.probe(names) == 5


def test_delete(tier):
    root, chain, names = acme_chain(2)
    for i in range(2):
        tier.write(names[i], make_snapshot(root, chain[i]), expires_at=0)

    assert tier.delete(names[0]) is True
    assert tier.read(names[0]) is None
    assert tier.exists(names[0]) is False
    assert tier.exists(names[1]) is True  # only the named object went
    assert tier.delete(names[0]) is False  # not there any more


def test_entries_per_tenant_prefix_skip_meta_and_quarantine(tier):
    root_a, chain_a, names_a = acme_chain(3)
    root_b = make_root(BOLT)
    chain_b = make_chain(root_b, 1)
    name_b = object_name(BOLT.name, chain_b[0].key)
    sizes = {}
    before = time.time()
    for i in range(3):
        raw = snapshot_bytes(make_snapshot(root_a, chain_a[i]))
        tier.write(names_a[i], raw, expires_at=0)
        sizes[names_a[i]] = len(raw)
    raw_b = snapshot_bytes(make_snapshot(root_b, chain_b[0], tenant=BOLT))
    tier.write(name_b, raw_b, expires_at=0)
    sizes[name_b] = len(raw_b)
    tier.put_meta("tenants/acme.json", b"{}")
    assert tier.quarantine(names_a[2], "test") is not None
    del sizes[names_a[2]]

    acme = list(tier.entries("acme/"))
    bolt = list(tier.entries("bolt/"))
    everything = list(tier.entries())

    assert sorted(e.name for e in acme) == sorted(names_a[:2])
    assert [e.name for e in bolt] == [name_b]
    assert sorted(e.name for e in everything) == sorted(sizes)
    for e in everything:
        assert e.size == sizes[e.name]
        # GC ages objects of uncapped tiers by this time: it must be a real wall clock
        assert before - 60 <= e.mtime <= time.time() + 60, e
    assert list(tier.entries("nobody/")) == []


def test_meta_round_trip(tier):
    assert tier.get_meta("tenants/acme.json") is None
    tier.put_meta("tenants/acme.json", b'{"salt_id": "1"}')
    assert tier.get_meta("tenants/acme.json") == b'{"salt_id": "1"}'
    tier.put_meta("tenants/acme.json", b'{"salt_id": "2"}')
    assert tier.get_meta("tenants/acme.json") == b'{"salt_id": "2"}'
    assert tier.get_meta("tenants/bolt.json") is None


def test_a_capped_meta_read_refuses_an_object_over_the_cap(tier):
    assert tier.get_meta_capped("fleet/acme/node-a.json", 10) is None
    tier.put_meta("fleet/acme/node-a.json", b"0123456789")
    assert tier.get_meta_capped("fleet/acme/node-a.json", 10) == b"0123456789"
    with pytest.raises(StoreRecordInvalid, match="more than the 9"):
        tier.get_meta_capped("fleet/acme/node-a.json", 9)
    tier.put_meta("fleet/acme/node-a.json", b"")
    assert tier.get_meta_capped("fleet/acme/node-a.json", 9) == b""


def test_list_meta_names_what_a_prefix_holds(tier):
    assert tier.list_meta("fleet/") == []
    for name in ("fleet/acme/node-b.json", "fleet/acme/node-a.json", "fleet/acme-2/node-a.json",
                 "fleet/bolt/node-a.json", "tenants/acme.json"):
        tier.put_meta(name, b"{}")

    assert tier.list_meta("fleet/acme/") == ["fleet/acme/node-a.json", "fleet/acme/node-b.json"]
    # a prefix is a string prefix, not only a folder
    assert tier.list_meta("fleet/acme") == ["fleet/acme-2/node-a.json", "fleet/acme/node-a.json",
                                            "fleet/acme/node-b.json"]
    assert tier.list_meta("fleet/acme/node-b") == ["fleet/acme/node-b.json"]
    assert tier.list_meta("fleet/nobody/") == []
    assert set(tier.list_meta("")) >= {"fleet/bolt/node-a.json", "tenants/acme.json"}
    tier.put_meta("fleet/acme/node-a.json", b'{"again": 1}')
    assert tier.list_meta("fleet/acme/") == ["fleet/acme/node-a.json", "fleet/acme/node-b.json"]


def test_quarantine_moves_the_object_aside(tier_case):
    tier = tier_case.tier
    root, chain, names = acme_chain(2)
    raw = snapshot_bytes(make_snapshot(root, chain[0]))
    tier.write(names[0], raw, expires_at=0)
    tier.write(names[1], make_snapshot(root, chain[1]), expires_at=0)

    where = tier.quarantine(names[0], "payload checksum mismatch")

    assert where is not None
    assert tier.read(names[0]) is None
    assert tier.exists(names[0]) is False
    assert tier.read(names[1]) is not None  # neighbours untouched
    assert tier_case.evidence(where) == raw  # kept intact for inspection, never deleted
    q = tier.quarantined()
    assert len(q) == 1 and chain[0].key in q[0].name and q[0].size == len(raw)
    assert tier.quarantine(names[0], "again") is None  # nothing left at that name
    assert len(tier.quarantined()) == 1

    # rewritten, bad again: the second quarantine keeps the first one's evidence
    tier.write(names[0], raw, expires_at=0)
    second = tier.quarantine(names[0], "bad again")
    assert second is not None and second != where
    assert tier_case.evidence(where) == raw and tier_case.evidence(second) == raw
    assert len(tier.quarantined()) == 2


def test_a_mappable_tier_names_the_file_of_each_object(tier):
    root, chain, names = acme_chain(1)
    raw = snapshot_bytes(make_snapshot(root, chain[0]))
    tier.write(names[0], raw, expires_at=0)
    if tier.mappable:
        assert not tier.remote  # a file to map is a local one
        assert tier.path(names[0]).read_bytes() == raw
    else:
        with pytest.raises(NotImplementedError, match="no local files"):
            tier.path(names[0])


def test_a_capped_tier_removes_what_expired(tier):
    root, chain, names = acme_chain(2)
    now = time.time()
    old, live = make_snapshot(root, chain[0], created_at=now - 7200, ttl_s=3600), make_snapshot(root, chain[1])
    tier.write(names[0], old, expires_at=old.header.expires_at)
    tier.write(names[1], live, expires_at=live.header.expires_at)
    if tier.capped:
        done = tier.housekeep(now)
        assert done.expired_removed == 1
        assert [e.name for e in tier.entries()] == [names[1]]
    else:
        with pytest.raises(NotImplementedError, match="no expiry"):
            tier.housekeep(now)
        assert sorted(e.name for e in tier.entries()) == sorted(names)
