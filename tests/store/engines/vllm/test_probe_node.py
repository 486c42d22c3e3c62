"""The scheduler's probe with the node process: the node's answer equals the NVMe tier's, and a dead
node leaves the probe to the tier (no vLLM needed: the probe is pure store code)."""
from __future__ import annotations

import signal

from store.engines.vllm.probe import StoreProbe
from store.engines.vllm.tenancy import TenantBook
from store.node import NodeClient
from store.tiers.store import Store
from tests.store.node.factories import gone, node_config, stop
from tests.store.pool_workers import TINY, prompt, synthetic_prefix

BS = 16


def test_the_probe_asks_the_node_and_the_tier_when_the_node_is_gone(tmp_path, sock_dir, node_pids, monkeypatch):
    config = node_config(tmp_path / "nvme", sock_dir / "n.sock",
                         tenants={"acme": {"secret_env": "KVWARM_TEST_ACME_SECRET"}})
    monkeypatch.setenv("KVWARM_TEST_ACME_SECRET", "acme-secret-of-sixteen")
    tenants = TenantBook(config, "acme")
    store = Store.open(config.store.url, config)
    ids = prompt(5 * BS + 2)
    synthetic_prefix(store, config, ids[:3 * BS], layers=2, heads=2, head_dim=16, tenant=tenants.credentials("acme"))
    alone = StoreProbe(store, (TINY, None), config.kv_cache.precision(), BS, tenants)
    with NodeClient(config) as client:
        node_pids.append(pid := client.connect()["pid"])
        probe = StoreProbe(store, (TINY, None), config.kv_cache.precision(), BS, tenants, node=client)
        for asked in (ids, ids[:2 * BS], prompt(4 * BS, seed=9)):
            assert probe.probe("acme", asked) == alone.probe("acme", asked)
        assert probe.probe("acme", ids).blocks == 3 and probe.node_fallbacks == 0
        assert client.stats()["lookups"] >= 3  # the node answered them
        stop(pid, signal.SIGKILL)
        assert gone(pid)
        assert probe.probe("acme", ids) == alone.probe("acme", ids)  # the tier answers meanwhile
        assert probe.node_fallbacks >= 1
    store.close()
