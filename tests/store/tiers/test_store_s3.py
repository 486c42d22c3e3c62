"""The tiered Store over [LocalTier, S3Tier] against real SeaweedFS servers.

Read-through, fleet sharing, encryption at rest, corruption on S3 and GC of remote
objects; the S3 tier being down or hanging is tests/store/tiers/test_store_s3_outage.py.
"""
from __future__ import annotations

import os
import time

import pytest

from store.errors import SnapshotCorrupt, SnapshotError, TenantAccessDenied
from store.format.encode import snapshot_bytes
from store.identity.tenant import Tenant
from store.tiers.crypto import MAGIC
from store.tiers.maintenance import gc
from store.tiers.store import Probe
from tests.store.factories import ACME
from tests.store.tiers.s3_nodes import assert_same, chain_of, node, raw_path

pytestmark = pytest.mark.s3


# -- read-through and fleet sharing ------------------------------------------------

def test_read_through_from_s3_into_the_local_tier(tmp_path, s3_url, s3_config):
    store, local, s3 = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(ACME, 1)
    assert store.put(ACME, snaps[0]) is True
    assert local.exists(names[0]) and s3.exists(names[0])

    assert local.delete(names[0]) is True
    got = store.get(ACME, chain[0], root)

    assert_same(got, snaps[0])
    assert store.stats["read_through"] == 1
    assert local.exists(names[0])
    # served from the local copy it just wrote: a memory map of the NVMe file
    assert got.location == local.describe(names[0])
    mapped = local.read(names[0])
    assert mapped is not None and mapped.to_pybytes() == snapshot_bytes(snaps[0])

    again = store.get(ACME, chain[0], root)
    assert_same(again, snaps[0])
    assert store.stats["read_through"] == 1  # the second read is a local hit
    assert store.stats["hits"] == 2


def test_a_second_node_gets_what_the_first_wrote(tmp_path, s3_url, s3_config):
    writer, _, _ = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(ACME, 3)
    for s in snaps:
        writer.put(ACME, s)

    reader, local_b, _ = node(tmp_path, "b", s3_url, s3_config)
    assert local_b.probe(names) == 0
    assert reader.probe(ACME, chain, root) == Probe(3, "s3")
    for b, s in zip(chain, snaps):
        assert_same(reader.get(ACME, b, root), s)
    assert reader.stats["read_through"] == 3
    assert local_b.probe(names) == 3
    assert reader.probe(ACME, chain, root) == Probe(3, "nvme")
    assert [x.key for x in reader.list(ACME)] == sorted(b.key for b in chain)


def test_a_wrong_secret_is_refused_by_the_fleet_namespace_marker(tmp_path, s3_url, s3_config):
    writer, _, _ = node(tmp_path, "a", s3_url, s3_config)
    _, _, snaps, _ = chain_of(ACME, 1)
    writer.put(ACME, snaps[0])

    impostor = Tenant.derive("acme", "not-the-secret")
    iroot, ichain, _, _ = chain_of(impostor, 1)
    fresh, _, _ = node(tmp_path, "b", s3_url, s3_config)  # its NVMe tier knows nobody yet
    with pytest.raises(TenantAccessDenied):
        fresh.get(impostor, ichain[0], iroot)
    assert fresh.stats["refused"] == 1


def test_a_refused_writer_does_not_claim_the_local_namespace(tmp_path, s3_url, s3_config):
    writer, _, _ = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, _ = chain_of(ACME, 1)
    writer.put(ACME, snaps[0])

    impostor = Tenant.derive("acme", "not-the-secret")
    _, _, isnaps, inames = chain_of(impostor, 1)
    fresh, local_b, _ = node(tmp_path, "b", s3_url, s3_config)
    with pytest.raises(TenantAccessDenied):
        fresh.put(impostor, isnaps[0])
    assert not local_b.exists(inames[0])
    assert_same(fresh.get(ACME, chain[0], root), snaps[0])  # the real tenant still reads on node b


# -- encryption at rest -------------------------------------------------------------

def test_s3_objects_are_encrypted_and_read_back_through_the_store(tmp_path, s3_url, s3_config, raw_s3):
    tenant = Tenant.derive("acme", "secret", os.urandom(32))
    store, local, s3 = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(tenant, 1)
    store.put(tenant, snaps[0])
    plain = snapshot_bytes(snaps[0])
    h = snaps[0].header

    blob = raw_s3.cat(raw_path(s3_url, names[0]))
    assert blob.startswith(MAGIC)
    for secret in (h.model_fingerprint.encode(), h.tokens_sha256.encode(), h.key.encode(), b"ARROW1",
                   bytes(snaps[0].buffers[0][:64])):
        assert secret not in blob
    assert len(blob) == len(MAGIC) + 8 + 12 + len(plain) + 16  # key id, nonce, ciphertext, GCM tag
    assert local.read(names[0]).to_pybytes() == plain  # the NVMe copy stays plaintext and mappable

    local.delete(names[0])
    assert_same(store.get(tenant, chain[0], root), snaps[0])
    assert store.stats["read_through"] == 1
    assert local.read(names[0]).to_pybytes() == plain

    other, _, _ = node(tmp_path, "b", s3_url, s3_config)  # another node holding the same key
    assert_same(other.get(tenant, chain[0], root), snaps[0])


def test_an_encrypted_object_copied_under_another_name_is_corrupt(tmp_path, s3_url, s3_config, raw_s3):
    tenant = Tenant.derive("acme", "secret", os.urandom(32))
    store, local, s3 = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(tenant, 2)
    store.put(tenant, snaps[0])
    raw_s3.pipe(raw_path(s3_url, names[1]), raw_s3.cat(raw_path(s3_url, names[0])))

    with pytest.raises(SnapshotCorrupt, match="authentication"):
        store.get(tenant, chain[1], root)

    # caught by the AAD before any header check (a SnapshotMismatch would mean it decrypted)
    assert store.stats["corrupt"] == 1 and store.stats["mismatched"] == 0
    assert store.stats["quarantined"] == 1
    assert not s3.exists(names[1])
    assert len(s3.quarantined()) == 1 and chain[1].key in s3.quarantined()[0].name
    assert not local.exists(names[1])
    assert store.get(tenant, chain[1], root) is None  # never served afterwards
    local.delete(names[0])
    assert_same(store.get(tenant, chain[0], root), snaps[0])  # the original is untouched


def test_a_node_missing_the_encryption_key_refuses_but_never_quarantines(tmp_path, s3_url, s3_config):
    keyed = Tenant.derive("acme", "secret", os.urandom(32))
    unkeyed = Tenant.derive("acme", "secret")  # same tenant, encryption_key_env unset on this node
    writer, _, _ = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(keyed, 1)
    writer.put(keyed, snaps[0])

    misconfigured, local_b, s3 = node(tmp_path, "b", s3_url, s3_config)
    with pytest.raises(SnapshotError, match="no encryption key") as err:
        misconfigured.get(unkeyed, chain[0], root)

    # the object is sound, this node is misconfigured: refuse, never take it from the fleet
    assert not isinstance(err.value, SnapshotCorrupt)
    assert misconfigured.stats["quarantined"] == 0 and s3.quarantined() == []
    assert s3.exists(names[0]) and not local_b.exists(names[0])
    third, _, _ = node(tmp_path, "c", s3_url, s3_config)
    assert_same(third.get(keyed, chain[0], root), snaps[0])
    assert misconfigured.stats["undecryptable"] == 1 and misconfigured.stats["corrupt"] == 0


def test_a_node_with_another_key_refuses_but_never_quarantines(tmp_path, s3_url, s3_config):
    """A key rotation not yet rolled out everywhere: the key id tells it from tampering."""
    old = Tenant.derive("acme", "secret", os.urandom(32))
    rotated = Tenant.derive("acme", "secret", os.urandom(32))
    writer, _, _ = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(old, 1)
    writer.put(old, snaps[0])
    other, _, s3 = node(tmp_path, "b", s3_url, s3_config)
    with pytest.raises(SnapshotError, match="encrypted with key id") as err:
        other.get(rotated, chain[0], root)
    assert not isinstance(err.value, SnapshotCorrupt)
    assert other.stats["undecryptable"] == 1 and other.stats["quarantined"] == 0
    assert s3.exists(names[0]) and s3.quarantined() == []


# -- corruption on S3 ------------------------------------------------------------------

def test_a_corrupt_s3_object_is_refused_and_quarantined(tmp_path, s3_url, s3_config, raw_s3):
    store, local, s3 = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(ACME, 1)
    store.put(ACME, snaps[0])
    local.delete(names[0])
    path = raw_path(s3_url, names[0])
    raw = bytearray(raw_s3.cat(path))
    payload = bytes(snaps[0].buffers[0])
    at = raw.find(payload)
    assert at > 0 and raw.count(payload) == 1
    raw[at + len(payload) // 2] ^= 0x5A  # one byte inside the first payload part
    raw_s3.pipe(path, bytes(raw))

    with pytest.raises(SnapshotCorrupt, match="checksum"):
        store.get(ACME, chain[0], root)

    assert store.stats["corrupt"] >= 1 and store.stats["quarantined"] == 1
    assert not s3.exists(names[0])
    assert [chain[0].key in e.name for e in s3.quarantined()] == [True]
    assert not local.exists(names[0])  # never copied into the NVMe tier
    assert store.get(ACME, chain[0], root) is None  # and never returned
    assert store.probe(ACME, chain, root) == Probe(0, None)


# -- GC of remote objects --------------------------------------------------------------

def test_gc_deletes_s3_objects_older_than_ttl_max(tmp_path, s3_url, s3_config):
    store, local, s3 = node(tmp_path, "a", s3_url, s3_config)
    root, chain, snaps, names = chain_of(ACME, 2)
    store.put(ACME, snaps[0])
    m_old = {e.name: e.mtime for e in s3.entries()}[names[0]]
    while time.time() < m_old + 1.5:  # LastModified has one-second resolution
        time.sleep(0.2)
    store.put(ACME, snaps[1])
    m_young = {e.name: e.mtime for e in s3.entries()}[names[1]]
    assert m_young > m_old
    ttl = 3600.0
    now = m_old + ttl + (m_young - m_old) / 2  # past the old one's TTL bound, not the young one's

    assert gc(store, ttl_max_s=ttl).remote_expired_removed == 0  # now: nothing is that old
    assert gc(store, now=now).remote_expired_removed == 0  # no ttl_max_s: remote objects are left alone
    assert s3.exists(names[0]) and s3.exists(names[1])

    report = gc(store, now=now, ttl_max_s=ttl)

    assert report.remote_expired_removed == 1
    assert not s3.exists(names[0])
    assert s3.exists(names[1])
    assert local.exists(names[0]) and local.exists(names[1])  # local copies follow their own expiry
