"""Serving nodes over a shared S3 bucket for the tiered-Store tests: a node's Store over its own
NVMe directory and the shared S3 URL, a tenant's chain of snapshots, and a check that a
snapshot read back is the one written."""
from __future__ import annotations

import numpy as np

from store.config import S3Config
from store.format.encode import EncodedSnapshot
from store.format.snapshot import Snapshot
from store.identity.tenant import Tenant
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.s3 import S3Tier
from store.tiers.store import Store
from tests.store.factories import make_chain, make_root, make_snapshot

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
