"""Tenant isolation: B cannot read, list or probe A's snapshots; every attempt is counted."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from store.errors import SnapshotMismatch, TenantAccessDenied
from store.identity.tenant import PUBLIC, PUBLIC_TENANT, Tenant
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.factories import ACME, BOLT, make_chain, make_root, make_snapshot


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    s = Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)])
    root = make_root(ACME)
    for b in make_chain(root, 3):
        s.put(ACME, make_snapshot(root, b, tenant=ACME))
    return s


def test_owner_reads_lists_and_probes(store: Store) -> None:
    root = make_root(ACME)
    chain = make_chain(root, 3)
    assert store.probe(ACME, chain, root).count == 3
    assert store.get(ACME, chain[1], root) is not None
    assert len(store.list(ACME)) == 3
    assert store.stats["refused"] == 0


def test_other_tenant_cannot_even_name_the_keys(store: Store) -> None:
    # B computes keys for the same tokens with its own salt: they are different keys,
    # so B's reads are plain misses in B's own namespace.
    root_b = make_root(BOLT)
    chain_b = make_chain(root_b, 3)
    assert {b.key for b in chain_b}.isdisjoint({b.key for b in make_chain(make_root(ACME), 3)})
    assert store.probe(BOLT, chain_b, root_b).count == 0
    assert store.get(BOLT, chain_b[0], root_b) is None
    assert store.list(BOLT) == []


def test_listing_another_namespace_is_refused_and_counted(store: Store) -> None:
    with pytest.raises(TenantAccessDenied, match="'bolt' may not list namespace 'acme'"):
        store.list(BOLT, "acme")
    with pytest.raises(TenantAccessDenied):
        store.delete(BOLT, make_chain(make_root(ACME), 1)[0].key, "acme")
    assert store.stats["refused"] == 2
    assert len(store.list(ACME)) == 3  # nothing was deleted


def test_wrong_secret_for_a_tenant_name_is_refused_and_counted(store: Store) -> None:
    # An impostor claims the name "acme" without acme's secret and uses acme's real keys
    # (say, leaked from a log): the namespace records its owner's salt id.
    impostor = Tenant("acme", BOLT.salt)
    real_chain = make_chain(make_root(ACME), 3)
    forged_root = dataclasses.replace(make_root(ACME), tenant_salt=impostor.salt)
    with pytest.raises(TenantAccessDenied, match="without its owner's secret"):
        store.probe(impostor, real_chain, forged_root)
    with pytest.raises(TenantAccessDenied):
        store.get(impostor, real_chain[0], forged_root)
    with pytest.raises(TenantAccessDenied):
        store.list(impostor)
    with pytest.raises(TenantAccessDenied):
        store.put(impostor, make_snapshot(forged_root, make_chain(forged_root, 1)[0], tenant=impostor))
    assert store.stats["refused"] == 4


def test_reading_with_a_root_salted_for_someone_else_is_refused(store: Store) -> None:
    root_a = make_root(ACME)
    with pytest.raises(TenantAccessDenied, match="salted for another tenant"):
        store.get(BOLT, make_chain(root_a, 1)[0], root_a)
    with pytest.raises(TenantAccessDenied):
        store.probe(BOLT, make_chain(root_a, 1), root_a)
    with pytest.raises(TenantAccessDenied):
        store.put(BOLT, make_snapshot(root_a, make_chain(root_a, 1)[0], tenant=ACME))
    assert store.stats["refused"] == 3


def test_snapshot_planted_in_another_namespace_is_never_served(store: Store, tmp_path: Path) -> None:
    # Someone with disk access copies acme's file into bolt's directory under a bolt key.
    local = store.local
    assert local is not None
    root_b = make_root(BOLT)
    store.put(BOLT, make_snapshot(root_b, make_chain(root_b, 1, start=500)[0], tenant=BOLT))  # bolt owns its namespace
    target = make_chain(root_b, 1)[0]
    src = next(local.entries("acme/"))
    dst = local.path(f"bolt/{target.key[:2]}/{target.key}.kvw")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(local.path(src.name), dst)
    with pytest.raises(SnapshotMismatch):
        store.get(BOLT, target, root_b)
    assert store.stats["mismatched"] == 1 and store.stats["quarantined"] == 1
    assert not dst.exists()


def test_public_namespace_is_shared_on_purpose(store: Store) -> None:
    root_p = make_root(PUBLIC_TENANT)
    chain = make_chain(root_p, 2, start=1000)
    for b in chain:  # written by the public writer (the prefill job as tenant 'public')
        store.put(PUBLIC_TENANT, make_snapshot(root_p, b, tenant=PUBLIC_TENANT))
    # Any tenant reads, probes and lists public prefixes.
    assert store.probe(BOLT, chain, root_p).count == 2
    assert store.get(BOLT, chain[0], root_p) is not None
    assert len(store.list(BOLT, PUBLIC)) == 2
    assert store.stats["refused"] == 0


def test_namespace_markers_hold_across_store_instances(tmp_path: Path, store: Store) -> None:
    local = store.local
    assert local is not None
    again = Store([LocalTier(local.root, cap_bytes=64 << 20)])
    impostor = Tenant("acme", BOLT.salt)
    with pytest.raises(TenantAccessDenied):
        again.list(impostor)
    assert again.stats["refused"] == 1
