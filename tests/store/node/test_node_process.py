"""The node process, for real: `prefill node` and nodes clients start, talked to over their socket."""
from __future__ import annotations

import signal
import threading
import urllib.request

import pytest

from store.errors import NodeRefused, NodeUnavailable
from store.node import NodeClient
from store.tiers.store import Store
from tests.store.factories import ACME, make_chain, make_root, make_snapshot
from tests.store.node.factories import eventually, gone, node_config, start_prefill_node, stop, write_config


def stored_chain(url: str, config, n: int, held: int) -> tuple[list[str], object]:  # type: ignore[no-untyped-def]
    """A chain of ``n`` blocks whose first ``held`` are in the store at ``url``; (keys, root)."""
    root = make_root(ACME, block_size=16)
    chain = make_chain(root, n)
    store = Store.open(url, config)
    try:
        for block in chain[:held]:
            store.put(ACME, make_snapshot(root, block))
    finally:
        store.close()
    return [b.key for b in chain], root


def test_prefill_node_answers_hello_and_lookups_as_the_store_does(tmp_path, sock_dir, node_pids):
    sock = sock_dir / "n.sock"
    config = node_config(tmp_path / "store", sock)
    keys, root = stored_chain(config.store.url, config, 5, 3)
    proc = start_prefill_node(write_config(config, tmp_path / "kvwarm.json"), sock)
    node_pids.append(proc.pid)
    with NodeClient(config, autostart=False) as client:
        hello = client.connect()
        assert hello["pid"] == proc.pid and hello["node_tier"] == f"file://{tmp_path / 'store'}"
        store = Store.open(config.store.url, config)
        expected = store.probe(ACME, keys, root, local_only=True).count
        for asked in (keys, keys[:2], keys[3:], keys[:1]):
            hit = client.lookup("acme", asked)
            assert hit.count == store.probe(ACME, asked, root, local_only=True).count
            assert hit.paths == tuple(str(store.local.path(f"acme/{k[:2]}/{k}.kvw")) for k in asked[:hit.count])
        assert client.lookup("acme", keys).count == expected == 3
        assert client.lookup("bolt", keys).count == 0  # another namespace names other files
        store.close()
    stop(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not sock.exists()


def test_a_node_refuses_another_version_and_another_config_naming_them(tmp_path, sock_dir, node_pids):
    sock = sock_dir / "n.sock"
    config = node_config(tmp_path / "store", sock)
    proc = start_prefill_node(write_config(config, tmp_path / "kvwarm.json"), sock)
    node_pids.append(proc.pid)
    with pytest.raises(NodeRefused, match=r"runs kvwarm 0\..* this process kvwarm 9\.9\.9"):
        NodeClient(config, version="9.9.9", autostart=False).connect()
    other = node_config(tmp_path / "store", sock, kv_cache={"block_size": 32})
    with pytest.raises(NodeRefused) as refused:
        NodeClient(other, autostart=False).connect()
    msg = str(refused.value)
    assert "kv_cache.block_size = 32 here vs 16 in the node" in msg and "store.url" not in msg
    elsewhere = node_config(tmp_path / "other-store", sock, kv_cache={"compression": "bf16"})
    with pytest.raises(NodeRefused, match=r"kv_cache\.precision = .bf16/none. here vs .fp8.*; store\.url = .*other-store. here vs"):
        NodeClient(elsewhere).connect()  # refused: not a reason to start another node on its socket
    with NodeClient(config) as client:
        client.connect()
        assert client.stats()["hellos_refused"] == 3


def test_a_second_node_on_the_same_socket_refuses_to_start(tmp_path, sock_dir, node_pids):
    sock = sock_dir / "n.sock"
    cfg = write_config(node_config(tmp_path / "store", sock), tmp_path / "kvwarm.json")
    first = start_prefill_node(cfg, sock)
    node_pids.append(first.pid)
    import subprocess
    import sys

    from tests.store.node.factories import REPO, env

    second = subprocess.run([sys.executable, "-m", "prefill.cli", "node", "--config", str(cfg)], env=env(), cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert f"(pid {first.pid}) already serves {sock}" in second.stderr


def test_kill_9_of_the_node_client_reconnects_to_a_node_it_starts(tmp_path, sock_dir, node_pids):
    sock = sock_dir / "n.sock"
    config = node_config(tmp_path / "store", sock)
    keys, _ = stored_chain(config.store.url, config, 4, 2)
    client = NodeClient(config)
    assert not sock.exists()
    first = client.connect()["pid"]  # nothing answered: the client started one
    node_pids.append(first)
    assert client.lookup("acme", keys).count == 2
    stop(first, signal.SIGKILL)
    assert gone(first)
    with pytest.raises(NodeUnavailable):
        client.lookup("acme", keys)  # a miss for the caller, at once; the client reconnects meanwhile
    assert client.wait_connected(60)
    second = client.node["pid"]
    node_pids.append(second)
    assert second != first and client.reconnects == 1
    assert client.lookup("acme", keys).count == 2  # the new node serves the same tier
    client.close()


def test_two_clients_share_one_node_and_start_only_one(tmp_path, sock_dir, node_pids):
    sock = sock_dir / "n.sock"
    config = node_config(tmp_path / "store", sock)
    clients = [NodeClient(config) for _ in range(2)]
    pids: list[int] = []
    threads = [threading.Thread(target=lambda c=c: pids.append(c.connect()["pid"])) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    node_pids.extend(set(pids))
    assert len(pids) == 2 and pids[0] == pids[1]  # the second waited for the first one's node
    stats = clients[0].stats()
    assert stats["clients"] == 2 and stats["hellos"] == 2
    keys = [b.key for b in make_chain(make_root(ACME), 2)]
    clients[0].lookup("acme", keys)
    clients[1].lookup("acme", keys)
    assert clients[1].stats()["lookups"] == 2
    for c in clients:
        c.close()


def test_the_node_serves_prometheus_metrics_and_collects_garbage(tmp_path, sock_dir, node_pids):
    sock = sock_dir / "n.sock"
    config = node_config(tmp_path / "store", sock, node={"gc_interval_s": 0.2})
    root = make_root(ACME, block_size=16)
    chain = make_chain(root, 2)
    store = Store.open(config.store.url, config)
    store.put(ACME, make_snapshot(root, chain[0], ttl_s=3600))
    store.put(ACME, make_snapshot(root, chain[1], ttl_s=1, created_at=0.0))  # expired long ago
    expired = store.local.path(f"acme/{chain[1].key[:2]}/{chain[1].key}.kvw")
    store.close()
    assert expired.exists()
    with NodeClient(config) as client:
        node_pids.append(client.connect()["pid"])
        assert client.lookup("acme", [chain[0].key]).count == 1
        assert eventually(lambda: not expired.exists())  # GC of the node tier, on its interval
        stats = eventually(lambda: (s := client.stats())["gc_runs"] >= 2 and s)
        assert stats["gc_removed"] >= 1 and stats["last_gc"] is not None
        port = client.node["metrics_port"]
        assert port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    assert "kvwarm_node_lookups_total 1.0" in text
    assert "kvwarm_node_lookup_hits_total 1.0" in text
    assert "kvwarm_node_gc_runs_total" in text and 'kvwarm_node_info{' in text
    assert f'fingerprint="{client.hello.fingerprint}"' in text


def test_records_reach_fleet_memory(tmp_path, sock_dir, node_pids):
    sock = sock_dir / "n.sock"
    config = node_config(tmp_path / "store", sock, fleet_memory={"flush_s": 0.2, "node_id": "node-a"})
    keys = [b.key for b in make_chain(make_root(ACME), 3)]
    with NodeClient(config) as client:
        node_pids.append(client.connect()["pid"])
        client.record("acme", keys)
        fleet = tmp_path / "store" / "meta" / "fleet" / "acme" / "node-a.json"
        assert eventually(fleet.exists)
    from store.serving.fleet import read_fleet
    from store.tiers.registry import tiers_from_url

    tiers = tiers_from_url(config.store.url, config.store)
    assert {u.name for u in read_fleet(tiers, ["acme"], since=0)} == {f"acme/{k[:2]}/{k}.kvw" for k in keys}
