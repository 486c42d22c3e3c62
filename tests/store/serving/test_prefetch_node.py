"""A prefetch stream that handed its chain to the node: a newer prefetch stops its wait at once, and a node
that goes away while it waits leaves the stream to copy alone.

The node here is a stand-in client that keeps its chains queued for ever (or until it "dies"), which a
real node never does on cue; the node process itself is tested in tests/store/node/test_loader_prefetch_node.py.
The remote tier is a directory the store takes for one, its reads counted.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Sequence

from store.errors import NodeUnavailable
from store.identity.keys import block_chain
from store.serving.fetch import RemoteFetcher, Scope
from store.serving.metrics import LoaderMetrics
from store.serving.node_link import NodeLink
from store.serving.prefetch import Prefetcher
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.pool_workers import ACME, TINY, config, prompt, synthetic_prefix

BS = 16


class FarDir(LocalTier):
    """A directory the store takes for a remote tier; ``names`` lists what was read from it."""

    remote = True
    kind = "far"

    def __init__(self, root) -> None:  # type: ignore[no-untyped-def]
        super().__init__(root, cap_bytes=1 << 30)
        self.names: list[str] = []

    def read(self, name, *, readahead=False):  # type: ignore[no-untyped-def]
        self.names.append(name)
        return super().read(name, readahead=readahead)


class QueuedNode:
    """A node client whose copies stay queued: ``pending`` answers every key until ``dies`` is set,
    then the node is away (as a killed node's client answers)."""

    connected = True

    def __init__(self) -> None:
        self.node = {"pid": 0}
        self.handed: list[tuple[str, list[str]]] = []
        self.asked = threading.Event()
        self.dies = threading.Event()

    def _alive(self) -> None:
        if self.dies.is_set():
            raise NodeUnavailable("the test's node went away")

    def prefetch(self, namespace: str, keys: Sequence[str]) -> int:
        self._alive()
        self.handed.append((namespace, list(keys)))
        return len(keys)

    def pending(self, namespace: str, keys: Sequence[str]) -> int:
        self.asked.set()
        self._alive()
        return len(keys)

    def lookup(self, namespace: str, keys: Sequence[str]):  # type: ignore[no-untyped-def]
        raise NodeUnavailable("lookups go to the tier itself here")

    def close(self) -> None:
        pass


def setup(tmp_path, node: QueuedNode):  # type: ignore[no-untyped-def]
    cfg = config(BS, "bf16")
    prefixes = [prompt(3 * BS, seed=s) for s in (1, 2)]
    writer = Store([LocalTier(tmp_path / "far", cap_bytes=1 << 30)])
    for ids in prefixes:
        synthetic_prefix(writer, cfg, ids, layers=1, heads=1, head_dim=8)
    writer.close()
    far = FarDir(tmp_path / "far")
    store = Store([LocalTier(tmp_path / "nvme", cap_bytes=1 << 30), far])
    metrics = LoaderMetrics(store=store.stats)
    ex = cf.ThreadPoolExecutor(1)
    fetcher = RemoteFetcher(store, ACME, metrics, ex, timeout_s=60, backoff_s=3600)
    link = NodeLink(node)  # type: ignore[arg-type]
    scope = Scope(TINY.key_root(cfg.kv_cache.precision(), BS, ACME.salt), "acme")

    def probe(chain, s):  # type: ignore[no-untyped-def]
        return link.probe(s, chain, lambda: store.probe(ACME, chain, s.root, local_only=True).count)

    pf = Prefetcher(1, probe=probe, fetcher=fetcher, metrics=metrics, node=link)
    chains = [(block_chain(scope.root, ids), None, scope) for ids in prefixes]
    return pf, chains, far, store, ex


def test_a_newer_prefetch_stops_a_stream_waiting_for_the_node(tmp_path):
    node = QueuedNode()
    pf, chains, far, store, ex = setup(tmp_path, node)
    try:
        fut = pf.run(chains, 0, map_ahead=None)
        assert node.asked.wait(HANG_S)  # the stream waits for the node's copies of the first chain
        assert pf.supersede() == 1
        res = fut.result(timeout=HANG_S)
        assert (res.handed, res.fetched, res.superseded) == (3, 0, 1)  # the second chain never started
        assert [len(keys) for _, keys in node.handed] == [3] and far.names == []
    finally:
        pf.close()
        ex.shutdown()
        store.close()


def test_a_node_that_goes_away_while_a_stream_waits_leaves_it_to_copy_alone(tmp_path):
    node = QueuedNode()
    pf, chains, far, store, ex = setup(tmp_path, node)
    try:
        fut = pf.run(chains[:1], 0, map_ahead=None)
        assert node.asked.wait(HANG_S)
        node.dies.set()
        res = fut.result(timeout=HANG_S)
        assert (res.handed, res.fetched, res.failed) == (3, 3, {})  # handed, then copied here
        assert len(far.names) == 3
        assert store.probe(ACME, chains[0][0], chains[0][2].root, local_only=True).count == 3
    finally:
        pf.close()
        ex.shutdown()
        store.close()
