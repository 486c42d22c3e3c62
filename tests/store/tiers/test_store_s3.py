"""The tiered Store over [LocalTier, S3Tier] against real SeaweedFS servers.

Read-through, fleet sharing, encryption at rest, corruption on S3, GC of remote
objects, and the S3 tier being down or hanging (served from NVMe, bounded failures).
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from store.config import S3Config
from store.errors import SnapshotCorrupt, SnapshotError, StoreUnavailable, TenantAccessDenied
from store.format.encode import EncodedSnapshot, snapshot_bytes
from store.format.snapshot import Snapshot
from store.identity.tenant import Tenant
from store.tiers.base import object_name
from store.tiers.crypto import MAGIC
from store.tiers.local import LocalTier
from store.tiers.maintenance import gc
from store.tiers.s3 import S3Tier
from store.tiers.store import Probe, Store
from tests.hang_guard import HANG_S, returns
from tests.seaweedfs import SeaweedFS
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

pytestmark = pytest.mark.s3

CAP = 1 << 30


def node(tmp_path, sub: str, url: str, cfg: S3Config) -> tuple[Store, LocalTier, S3Tier]:
    """One serving node: its own NVMe directory, the shared S3 URL."""
    local = LocalTier(tmp_path / sub, cap_bytes=CAP)
    s3 = S3Tier(url, cfg, create_bucket=True)
    return Store([local, s3]), local, s3


def raw_path(url: str, name: str) -> str:
    return f"{url[len('s3://'):]}/{name}"


def assert_same(got: Snapshot | None, want: EncodedSnapshot) -> None:
    assert got is not None
    assert got.header == want.header
    for part, raw in zip(want.header.parts, want.buffers):
        assert np.array_equal(got.array(part.name), raw), part.name


def chain_of(tenant: Tenant, n: int):
    root = make_root(tenant)
    chain = make_chain(root, n)
    snaps = [make_snapshot(root, b, tenant=tenant, seed=i) for i, b in enumerate(chain)]
    names = [object_name(tenant.name, b.key) for b in chain]
    return root, chain, snaps, names


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


# -- S3 down or hanging ----------------------------------------------------------------

OUTAGE_BUCKET = "kvwarm-outage"


@pytest.fixture
def dedicated(s3_credentials):
    """A SeaweedFS of this test's own (the session server is never touched), with a
    short hard deadline and a read timeout longer than it, so the deadline is what bounds."""
    import s3fs

    server = SeaweedFS().start()
    try:
        fs = s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": server.endpoint},
                               skip_instance_cache=True)
        fs.mkdir(OUTAGE_BUCKET)
        fs.pipe(f"{OUTAGE_BUCKET}/warm", b"x")  # grows the bucket's volumes before the calls under test
        # our own server answered (not another one that raced us for the port)
        assert server.proc.poll() is None, f"SeaweedFS exited; see {server.dir / 'weed.log'}"
        cfg = S3Config(endpoint_url=server.endpoint, op_timeout_s=4, connect_timeout_s=1, read_timeout_s=60,
                       retries=2, **s3_credentials)
        yield server, cfg
    finally:
        if server.proc is not None:
            try:
                os.killpg(server.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()


def outage_node(tmp_path, url: str, cfg: S3Config) -> tuple[Store, LocalTier, S3Tier]:
    """A node for an outage test, its S3 calls under a roomy deadline until the test sets ``cfg``'s.

    The calls that set a test up (the bucket, the puts, a first probe) go to a server that
    is up, only slow on a loaded machine: the short deadline under test is for the outage.
    """
    return node(tmp_path, "a", url, cfg.model_copy(update={"op_timeout_s": 120.0}))


def s3_requests(monkeypatch, s3: S3Tier) -> list[str]:
    """What each request ``s3`` makes from now on was for (``GET <name>``, ``probe of 4 blocks``...)."""
    made: list[str] = []
    real = s3._call

    def counted(coro, what):  # type: ignore[no-untyped-def]
        made.append(what)
        return real(coro, what)

    monkeypatch.setattr(s3, "_call", counted)
    return made


def assert_unavailable(url: str, fn, *args, **kwargs) -> StoreUnavailable:
    """``fn(*args, **kwargs)`` raises StoreUnavailable naming ``url`` (and does not hang)."""
    with pytest.raises(StoreUnavailable) as err:
        returns(fn, *args, **kwargs)
    assert url in str(err.value)
    return err.value


def test_s3_down_nvme_keeps_serving_and_s3_calls_fail_fast(tmp_path, dedicated, monkeypatch):
    server, cfg = dedicated
    url = f"s3://{OUTAGE_BUCKET}/down"
    store, local, s3 = outage_node(tmp_path, url, cfg)
    root, chain, snaps, names = chain_of(ACME, 4)
    for s in snaps:
        store.put(ACME, s)
    for n in names[2:]:
        local.delete(n)  # blocks 2 and 3 now live only in S3
    assert store.probe(ACME, chain, root) == Probe(4, "s3")
    requests = s3_requests(monkeypatch, s3)
    s3.options = cfg  # the deadline under test

    server.stop()

    for b, s in zip(chain[:2], snaps[:2]):
        assert_same(returns(store.get, ACME, b, root), s)
    assert requests == []  # served from NVMe: never waited on S3
    err = assert_unavailable(url, store.get, ACME, chain[2], root)
    assert store.stats["unavailable"] >= 1
    assert not local.exists(names[2])
    assert "GET" in str(err)

    assert_unavailable(url, s3.exists, names[0])
    assert_unavailable(url, s3.probe, names)
    assert_unavailable(url, s3.write, names[0], snaps[0], expires_at=0)

    before = store.stats["unavailable"]
    probe = returns(store.probe, ACME, chain, root)
    assert probe == Probe(2, "nvme", ("s3",))  # degrades to the local count instead of raising, and says why
    assert store.stats["unavailable"] == before + 1


def wait_stopped(pid: int, timeout_s: float = HANG_S) -> None:
    """Wait until every thread of ``pid`` is stopped (SIGSTOP takes effect asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, f"server {pid} did not stop: thread states {states}"
        time.sleep(0.05)


def test_s3_hanging_fails_within_the_deadline(tmp_path, dedicated, monkeypatch):
    server, cfg = dedicated
    url = f"s3://{OUTAGE_BUCKET}/hang"
    store, local, s3 = outage_node(tmp_path, url, cfg)
    roomy = s3.options
    root, chain, snaps, names = chain_of(ACME, 2)
    for s in snaps:
        store.put(ACME, s)
    local.delete(names[1])  # block 1 only in S3
    requests = s3_requests(monkeypatch, s3)
    s3.options = cfg  # the deadline under test

    os.killpg(server.proc.pid, signal.SIGSTOP)  # connections are accepted, never answered
    try:
        wait_stopped(server.proc.pid)
        assert_same(returns(store.get, ACME, chain[0], root), snaps[0])
        assert requests == []  # served from NVMe: never waited on S3
        # Nothing answers and the read timeout (60 s) is longer than the deadline (4 s):
        # each call that does end, ends by the deadline.
        deadline = f"did not finish within {cfg.op_timeout_s:g} s"
        err = assert_unavailable(url, store.get, ACME, chain[1], root)
        assert deadline in str(err)  # the hard deadline, not a refused connection
        before = store.stats["unavailable"]
        assert returns(store.probe, ACME, chain, root) == Probe(1, "nvme", ("s3",))
        assert store.stats["unavailable"] == before + 1  # the S3 probe ran into the deadline, and was counted
        assert deadline in str(assert_unavailable(url, s3.write, names[0], snaps[0], expires_at=0))
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)

    # the endpoint is back: the same tier and store work again (no poisoned client), given
    # the time a server just woken up may take to answer on a loaded machine
    s3.options = roomy
    assert s3.exists(names[1])
    assert_same(store.get(ACME, chain[1], root), snaps[1])
    assert store.stats["read_through"] == 1
