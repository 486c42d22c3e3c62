"""The node's copies from S3 into its tier: a client's prefetch hint, and the agent following a published plan."""
from __future__ import annotations

import uuid

from store.node import NodeClient
from store.published_plan import PublishedEntry, PublishedPlan, publish_plan, root_id
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.factories import ACME, make_chain, make_root, make_snapshot
from tests.store.node.factories import eventually, node_config


def test_the_node_copies_a_hinted_chain_and_the_published_plan_from_s3(tmp_path, sock_dir, node_pids, moto_endpoint,
                                                                       s3_credentials):
    s3_url = f"s3://kvwarm-node-tests/t-{uuid.uuid4().hex[:12]}"
    s3 = {"endpoint_url": moto_endpoint, "op_timeout_s": 20, "connect_timeout_s": 5, "read_timeout_s": 10,
          "retries": 1, **s3_credentials}
    config = node_config(tmp_path / "node-tier", sock_dir / "n.sock",
                         store={"s3": s3, "url": f"file://{tmp_path / 'node-tier'},{s3_url}"},
                         agent={"poll_s": 0.2}, fleet_memory={"enabled": False})
    root = make_root(ACME, block_size=16)
    planned, hinted = make_chain(root, 3), make_chain(root, 2, start=10_000)
    writer = Store.open(f"file://{tmp_path / 'writer'},{s3_url}", config, create_bucket=True)
    for block in planned + hinted:
        writer.put(ACME, make_snapshot(root, block))
    assert isinstance(writer.tiers[0], LocalTier)
    publish_plan(PublishedPlan(entries=(PublishedEntry("acme", root_id(root), tuple(b.key for b in planned),
                                                       expected_hits=5.0, score=1.0),)), writer.tiers[1:])
    writer.close()

    with NodeClient(config) as client:
        node_pids.append(client.connect()["pid"])
        planned_keys, hinted_keys = [b.key for b in planned], [b.key for b in hinted]
        # the agent reads the published plan and copies its chain, in prefix order
        assert eventually(lambda: client.lookup("acme", planned_keys).count == 3)
        assert client.lookup("acme", hinted_keys).count == 0  # not planned: not copied
        assert client.prefetch("acme", hinted_keys) == 2
        assert eventually(lambda: client.lookup("acme", hinted_keys).count == 2)
        copies = client.stats()["copies"]
        assert copies["copied"] == 5 and not {"refused", "mismatch", "unavailable"} & set(copies)
    # what the node copied is what the writer stored, and sound
    node_tier = Store.open(f"file://{tmp_path / 'node-tier'}", config)
    for block in planned + hinted:
        assert node_tier.get(ACME, block, root) is not None
    node_tier.close()
