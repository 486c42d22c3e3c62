"""KVLoader with the node process: lookups through the node when one runs, alone when none does or it dies."""
from __future__ import annotations

import signal

from store.node import NodeClient
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.store.node.factories import gone, node_config, stop
from tests.store.pool_workers import ACME, TINY, prompt, synthetic_prefix

BS = 16


def stored(tmp_path, config, ids) -> int:  # type: ignore[no-untyped-def]
    store = Store.open(config.store.url, config)
    try:
        return synthetic_prefix(store, config, ids, layers=2, heads=2, head_dim=16)
    finally:
        store.close()


def loader(tmp_path, config, **kw) -> KVLoader:  # type: ignore[no-untyped-def]
    return KVLoader(config.store.url, tenant=ACME, model=TINY, config=config, pool_bytes=1 << 30,
                    pool_dir=tmp_path / "pool", **kw)


def test_a_loader_looks_up_through_the_node_and_alone_once_it_is_gone(tmp_path, sock_dir, node_pids):
    config = node_config(tmp_path / "nvme", sock_dir / "n.sock")
    ids = prompt(4 * BS + 3)
    assert stored(tmp_path, config, ids) == 4
    with NodeClient(config) as client:
        pid = client.connect()["pid"]
        node_pids.append(pid)
        with loader(tmp_path, config, node="auto") as ld:
            assert ld.stats()["node"] == pid
            hit = ld.lookup(ids)
            assert hit is not None and len(hit.blocks) == 4
            hit.release()
            assert client.stats()["lookup_hits"] == 4  # the loader asked the node
            stop(pid, signal.SIGKILL)
            assert gone(pid)
            hit = ld.lookup(ids)  # the node is gone: the loader's own probe answers
            assert hit is not None and len(hit.blocks) == 4
            hit.release()
            assert ld.stats()["node_fallbacks"] >= 1


def test_a_loader_with_no_node_works_alone_and_starts_none(tmp_path, sock_dir):
    config = node_config(tmp_path / "nvme", sock_dir / "n.sock")
    ids = prompt(2 * BS + 1, seed=3)
    stored(tmp_path, config, ids)
    with loader(tmp_path, config, node="auto") as ld:
        assert ld.stats()["node"] is None
        hit = ld.lookup(ids)
        assert hit is not None and len(hit.blocks) == 2
        hit.release()
    assert not (sock_dir / "n.sock").exists()
