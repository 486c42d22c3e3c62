"""Fleet memory across nodes: a fleet sharing its records through S3, and the loader recording what it serves."""
from __future__ import annotations

import secrets
import time
import uuid

import pytest

from store.config import S3Config, StoreConfig, with_values
from store.identity.keys import block_chain
from store.identity.tenant import PUBLIC_TENANT
from store.serving.fetch import Scope
from store.serving.fleet import FleetRecorder, read_fleet
from store.serving.loader import KVLoader
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.registry import tier_class
from store.tiers.stats import StoreStats
from tests.hang_guard import HANG_S
from tests.store.pool_workers import ACME, TINY, config, prompt

T0 = 1_700_000_000.0
BUCKET = "kvwarm-fleet"


def names(ns: str, n: int) -> list[str]:
    return [object_name(ns, secrets.token_hex(32)) for _ in range(n)]


def local(tmp_path, name: str) -> LocalTier:
    return LocalTier(tmp_path / name, cap_bytes=1 << 30)


@pytest.fixture(params=["s3-moto", pytest.param("s3-seaweedfs", marks=pytest.mark.s3)])
def s3_tier(request, s3_credentials):
    if request.param == "s3-moto":
        cfg = S3Config(endpoint_url=request.getfixturevalue("moto_endpoint"), op_timeout_s=10, connect_timeout_s=2,
                       read_timeout_s=8, retries=1, **s3_credentials)
        url = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:16]}"
    else:
        cfg, url = request.getfixturevalue("s3_config"), request.getfixturevalue("s3_url")
    tier = tier_class(url).from_url(url, StoreConfig(s3=cfg), create_bucket=True)
    tier.s3_config = cfg  # for a loader on the same bucket
    yield tier
    tier.close()


def test_a_new_node_reads_what_the_fleet_wrote_to_s3(tmp_path, s3_tier):
    served_a, served_b, bolt = names("acme", 3), names("acme", 2), names("bolt", 1)
    a = FleetRecorder([local(tmp_path, "a"), s3_tier], "node-a", clock=lambda: T0 + 5)
    b = FleetRecorder([local(tmp_path, "b"), s3_tier], "node-b", clock=lambda: T0 + 5)
    a.record(served_a + bolt, now=T0)
    b.record(served_b + served_a[:1], now=T0 + 1)
    a.close()
    b.close()

    fresh = local(tmp_path, "fresh")  # a new node: an empty local tier, the fleet's S3
    uses = read_fleet([fresh, s3_tier], ["acme"], since=0)

    assert {u.name for u in uses} == set(served_a + served_b)
    assert {u.name: u for u in uses}[served_a[0]].uses == 2
    assert sorted(s3_tier.list_meta("fleet/")) == ["fleet/acme/node-a.json", "fleet/acme/node-b.json",
                                                   "fleet/bolt/node-a.json"]


def test_an_s3_copy_over_the_cap_or_empty_is_skipped_for_the_next_tier(tmp_path, s3_tier):
    served = names("acme", 2)
    rec = FleetRecorder([s3_tier, local(tmp_path, "slow")], "node-a", clock=lambda: T0 + 5)
    rec.record(served, now=T0)
    rec.close()
    good = s3_tier.get_meta("fleet/acme/node-a.json")
    stats = StoreStats()

    for bad in [good + b" " * 4096, b""]:  # over a cap of the good file's size plus a little; empty
        s3_tier.put_meta("fleet/acme/node-a.json", bad)
        uses = read_fleet([s3_tier, local(tmp_path, "slow")], ["acme"], since=0, stats=stats,
                          max_file_bytes=len(good) + 100)
        assert {u.name for u in uses} == set(served)
    assert stats["corrupt"] == 2 and stats["tier_failures"] == 0
    # a ranged read: at most the cap and one byte is fetched
    assert s3_tier.get_meta_capped("fleet/acme/node-a.json", 10) == b""
    s3_tier.put_meta("fleet/acme/node-a.json", good)
    assert s3_tier.get_meta_capped("fleet/acme/node-a.json", len(good)) == good


def loader(tmp_path, cfg, **kw):

    return KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=cfg, pool_bytes=1 << 30,
                    pool_dir=tmp_path / "pool", **kw)


def test_a_restarted_loader_reads_back_what_it_served(tmp_path):

    cfg = config(16)
    first = loader(tmp_path, cfg, node_id="gpu-node-1")
    ids = prompt(3 * 16 + 5, seed=1)
    blocks = block_chain(first.root, ids)
    first.record_use(blocks)  # the tenant's own namespace
    first.record_use(blocks[:1])
    public_scope = Scope(first.identity.key_root(first.precision, 16, PUBLIC_TENANT.salt), "public")
    shared = block_chain(public_scope.root, ids[:16])
    first.record_use(shared, public_scope)
    first.record_use([object_name("public", b.key) for b in shared])  # or object names, as the connector has them
    public = public_scope.names(shared)
    first.close()  # flushes

    second = loader(tmp_path, cfg, node_id="gpu-node-1")
    try:
        uses = second.fleet_uses(since=0)
        own = [object_name("acme", b.key) for b in blocks]
        assert {u.name for u in uses} == set(own + public)
        by_name = {u.name: u for u in uses}
        assert by_name[own[0]].uses == 2 and by_name[own[2]].uses == 1 and by_name[public[0]].uses == 2
        assert all(u.node == "gpu-node-1" for u in uses)
        assert second.stats()["fleet"] == {}  # nothing recorded or read wrong yet
    finally:
        second.close()


def test_a_replacement_node_reads_through_its_loader_what_the_old_one_served_to_s3(tmp_path, s3_tier):
    cfg = config(16).model_copy(update={"store": StoreConfig(s3=s3_tier.s3_config)})
    url = f"file://{tmp_path}/old,{s3_tier.url}"
    old = KVLoader(url, tenant=ACME, model=TINY, config=cfg, pool_dir=tmp_path / "pool-old", node_id="node-old")
    blocks = block_chain(old.root, prompt(2 * 16, seed=3))
    old.record_use(blocks)
    old.close()  # the node goes away; its local tier with it

    new = KVLoader(f"file://{tmp_path}/new,{s3_tier.url}", tenant=ACME, model=TINY, config=cfg,
                   pool_dir=tmp_path / "pool-new", node_id="node-new")
    try:
        uses = new.fleet_uses(since=0)
        assert [u.name for u in uses] == [object_name("acme", b.key) for b in blocks]
        assert {u.node for u in uses} == {"node-old"}
    finally:
        new.close()


def test_a_loader_skips_and_counts_a_record_over_its_configured_cap(tmp_path):
    cfg = with_values(config(16), "fleet_memory", {"max_file_bytes": 64 << 10}, source="test")
    first = loader(tmp_path, cfg, node_id="gpu-node-1")
    blocks = block_chain(first.root, prompt(2 * 16, seed=4))
    first.record_use(blocks)
    first.close()
    nvme = local(tmp_path, "nvme")
    nvme.put_meta("fleet/acme/big.json", b" " * (64 << 10) + nvme.get_meta("fleet/acme/gpu-node-1.json"))

    second = loader(tmp_path, cfg, node_id="gpu-node-2")
    try:
        assert [u.name for u in second.fleet_uses(since=0)] == [object_name("acme", b.key) for b in blocks]
        assert second.stats()["fleet"] == {"corrupt": 1}
    finally:
        second.close()


def test_a_loader_with_fleet_memory_off_records_nothing(tmp_path):

    cfg = with_values(config(16), "fleet_memory", {"enabled": False}, source="test")
    off = loader(tmp_path, cfg)
    off.record_use([object_name("acme", "a" * 64)])
    off.close()
    assert off.fleet is None and off.fleet_uses(since=0) == []
    assert local(tmp_path, "nvme").list_meta("fleet/") == []


def test_a_loader_flushes_in_the_background_every_flush_s(tmp_path):

    now = [T0]
    cfg = with_values(config(16), "fleet_memory", {"flush_s": 30}, source="test")
    node = loader(tmp_path, cfg, node_id="n1", clock=lambda: now[0])
    try:
        node.record_use([object_name("acme", "a" * 64)])
        assert node.local.list_meta("fleet/") == []
        now[0] += 31
        node.record_use([object_name("acme", "b" * 64)])  # due: written on the loader's own thread
        deadline = time.monotonic() + HANG_S
        while not node.local.list_meta("fleet/") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {u.name for u in node.fleet_uses(since=0)} == {object_name("acme", k * 64) for k in "ab"}
    finally:
        node.close()


def test_loaders_of_one_process_share_one_recorder(tmp_path):
    from tests.store.factories import BOLT

    cfg = config(16)
    shared = FleetRecorder([local(tmp_path, "nvme")], "node-1")
    acme = loader(tmp_path, cfg, fleet=shared)
    bolt = KVLoader(f"file://{tmp_path}/nvme", tenant=BOLT, model=TINY, config=cfg, pool_bytes=1 << 30,
                    pool_dir=tmp_path / "pool", fleet=shared)
    try:
        common = [object_name("public", "c" * 64)]  # a public prefix both tenants served
        acme.record_use(common + [object_name("acme", "a" * 64)])
        bolt.record_use(common + [object_name("bolt", "b" * 64)])
    finally:
        acme.close()
        bolt.close()
    assert shared.stats["files_written"] == 0  # its owner flushes it, not the loaders
    shared.close()

    # the public block was used last (and most): first
    assert [(u.name, u.uses) for u in acme.fleet_uses(since=0)] == [(common[0], 2),
                                                                     (object_name("acme", "a" * 64), 1)]
    assert {u.name for u in bolt.fleet_uses(since=0)} == {object_name("bolt", "b" * 64), common[0]}
