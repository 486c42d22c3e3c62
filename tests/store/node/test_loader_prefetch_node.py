"""A loader linked to the node process hands its prefetches' copies from S3 to the node: it makes no
S3 GET of its own, and maps the chains once the node tier holds them; with no node (or once the
node is gone) it copies alone. S3 is a moto server; the node is a real `prefill node` process."""
from __future__ import annotations

import signal
import uuid
from typing import Any

import numpy as np

from store.engines.vllm.fetches import RemoteFetches
from store.engines.vllm.tenancy import TenantBook
from store.identity.keys import block_chain
from store.node import NodeClient
from store.serving.fetch import Scope
from store.published_plan import PublishedEntry, PublishedPlan, publish_plan, root_id
from store.serving.loader import KVLoader
from store.serving.loader_node import start_agent
from store.tiers.store import Store
from tests.store.node.factories import HANG_S, eventually, gone, node_config, stop
from tests.store.pool_workers import ACME, TINY, prompt, synthetic_prefix

BS = 16
PROMPTS = [prompt(4 * BS + 5, seed=s) for s in (11, 12, 13)]  # 4 blocks each


def s3_node_config(tmp_path, sock_dir, moto_endpoint, s3_credentials, plan: bool = False,  # type: ignore[no-untyped-def]
                   **node: Any):
    """A node tier over a fresh moto S3 prefix holding :data:`PROMPTS` (and, with ``plan``, a published
    plan naming them); the node's agent off unless given."""
    s3_url = f"s3://kvwarm-node-tests/t-{uuid.uuid4().hex[:12]}"
    s3 = {"endpoint_url": moto_endpoint, "op_timeout_s": 20, "connect_timeout_s": 5, "read_timeout_s": 10,
          "retries": 1, **s3_credentials}
    tier = tmp_path / "node-tier"
    config = node_config(tier, sock_dir / "n.sock", store={"s3": s3, "url": f"file://{tier},{s3_url}"},
                         fleet_memory={"enabled": False}, agent={"poll_s": 0.2}, node={"agent": False, **node})
    writer = Store.open(f"file://{tmp_path / 'writer'},{s3_url}", config, create_bucket=True)
    try:  # stored by another node: only S3 holds them
        for i, ids in enumerate(PROMPTS):
            assert synthetic_prefix(writer, config, ids, layers=2, heads=2, head_dim=16, seed=i) == 4
        if plan:  # as the pipeline publishes it: keys, no tokens
            root = TINY.key_root(config.kv_cache.precision(), BS, ACME.salt)
            publish_plan(PublishedPlan(entries=tuple(
                PublishedEntry("acme", root_id(root), tuple(b.key for b in block_chain(root, np.asarray(ids))),
                               expected_hits=5.0, score=1.0) for ids in PROMPTS)), writer.tiers[1:])
    finally:
        writer.close()
    return config


class Requests:
    """What the loader's own S3 tier was asked (object names), counted as it is asked."""

    def __init__(self, monkeypatch, loader: KVLoader) -> None:  # type: ignore[no-untyped-def]
        (self.tier,) = [t for t in loader.store.tiers if t.remote]
        self.names: list[str] = []
        for method in ("read", "probe", "exists"):
            monkeypatch.setattr(self.tier, method, self._counted(getattr(self.tier, method)))

    def _counted(self, call):  # type: ignore[no-untyped-def]
        def counted(arg, *a, **kw):  # type: ignore[no-untyped-def]
            self.names.extend([arg] if isinstance(arg, str) else list(arg))
            return call(arg, *a, **kw)
        return counted


def loader(tmp_path, config, **kw) -> KVLoader:  # type: ignore[no-untyped-def]
    return KVLoader(config.store.url, tenant=ACME, model=TINY, config=config, pool_bytes=1 << 30,
                    pool_dir=tmp_path / "pool", fetch_mode="background", **kw)


def served(ld: KVLoader, ids) -> str | None:  # type: ignore[no-untyped-def]
    """Where a lookup of all of ``ids``'s blocks was served from (``None``: not all of them)."""
    hit = ld.lookup(ids)
    if hit is None:
        return None
    try:
        return hit.tier if len(hit.blocks) == 4 else None
    finally:
        hit.release()


def test_a_loader_linked_to_the_node_hands_its_prefetch_to_the_node_and_copies_nothing_itself(
        tmp_path, sock_dir, node_pids, moto_endpoint, s3_credentials, monkeypatch):
    config = s3_node_config(tmp_path, sock_dir, moto_endpoint, s3_credentials)
    with NodeClient(config) as client:
        pid = client.connect()["pid"]
        node_pids.append(pid)
        with loader(tmp_path, config, node="auto") as ld:
            asked = Requests(monkeypatch, ld)
            res = ld.prefetch(PROMPTS[:2]).result(timeout=HANG_S)
            assert (res.handed, res.fetched, res.mapped, res.failed) == (8, 0, 8, {})
            assert asked.names == []  # not one S3 request from the loader's process
            copies = client.stats()["copies"]
            assert copies.get("copied") == 8  # the node's copier made them
            assert [served(ld, ids) for ids in PROMPTS[:2]] == ["pool", "pool"]  # mapped ahead: in the pool
            stats = ld.stats()
            assert stats["prefetch_handed"] == 8 and stats.get("prefetch_fetched", 0) == 0
            assert stats["node"] == pid

            # a chain the node tier holds whole is neither handed nor copied again
            again = ld.prefetch(PROMPTS[:1]).result(timeout=HANG_S)
            assert (again.present, again.handed, again.fetched) == (4, 0, 0)
            assert client.stats()["copies"].get("copied") == 8

            # the node is gone: the loader copies alone
            stop(pid, signal.SIGKILL)
            assert gone(pid)
            alone = ld.prefetch(PROMPTS[2:]).result(timeout=HANG_S)
            assert (alone.handed, alone.fetched, alone.mapped) == (0, 4, 4)
            assert len(asked.names) >= 4
            assert served(ld, PROMPTS[2]) == "pool"
            assert ld.stats()["node_fallbacks"] >= 1


def test_a_loader_with_no_node_copies_its_prefetch_alone(tmp_path, sock_dir, moto_endpoint, s3_credentials,
                                                         monkeypatch):
    config = s3_node_config(tmp_path, sock_dir, moto_endpoint, s3_credentials)
    with loader(tmp_path, config, node="auto") as ld:
        assert ld.stats()["node"] is None
        asked = Requests(monkeypatch, ld)
        res = ld.prefetch(PROMPTS).result(timeout=HANG_S)
        assert (res.handed, res.fetched, res.mapped, res.failed) == (0, 12, 12, {})
        assert len(asked.names) >= 12
        assert [served(ld, ids) for ids in PROMPTS] == ["pool"] * 3
    assert not (sock_dir / "n.sock").exists()  # none was started


def test_the_nodes_agent_and_the_loaders_on_one_published_plan_copy_each_block_once_in_the_node(
        tmp_path, sock_dir, node_pids, moto_endpoint, s3_credentials, monkeypatch):
    config = s3_node_config(tmp_path, sock_dir, moto_endpoint, s3_credentials, plan=True, agent=True)
    with NodeClient(config) as client:
        node_pids.append(client.connect()["pid"])
        with loader(tmp_path, config, node="auto") as ld:
            asked = Requests(monkeypatch, ld)
            agent = start_agent(ld)  # the engine's agent, on the same plan as the node's
            try:
                assert eventually(lambda: ld.stats().get("prefetch_mapped", 0) == 12)
            finally:
                agent.close()
            assert asked.names == []  # the loader made no S3 request: the node copied
            copies = client.stats()["copies"]
            assert copies.get("copied") == 12 and not {"refused", "mismatch", "unavailable"} & set(copies)
            assert [served(ld, ids) for ids in PROMPTS] == ["pool"] * 3


def test_the_schedulers_background_copies_go_to_the_node_and_run_here_once_it_is_gone(
        tmp_path, sock_dir, node_pids, moto_endpoint, s3_credentials, monkeypatch):
    """vLLM's scheduler copies the rest of a chain NVMe lacks for next time (``fetch_mode: background``): with the
    node connected its copier makes the GETs, not vLLM's process; with the node gone, vLLM's process does."""
    config = s3_node_config(tmp_path, sock_dir, moto_endpoint, s3_credentials)
    root = TINY.key_root(config.kv_cache.precision(), BS, ACME.salt)
    scope = Scope(root, "acme")
    chains = [block_chain(root, np.asarray(ids)) for ids in PROMPTS]
    store = Store.open(config.store.url, config)
    (remote,) = [t for t in store.tiers if t.remote]
    asked: list[str] = []
    for method in ("read", "probe", "exists"):
        call = getattr(remote, method)
        monkeypatch.setattr(remote, method, lambda arg, *a, _call=call, **kw: asked.append(arg) or _call(arg, *a, **kw))
    with NodeClient(config) as client:
        pid = client.connect()["pid"]
        node_pids.append(pid)
        link = NodeClient(config, autostart=False)  # the scheduler's own client
        link.connect()
        book = TenantBook(config, "acme")
        monkeypatch.setattr(book, "credentials", lambda name: ACME)  # the stored chains' salt (the test's tenant)
        fetches = RemoteFetches(store, book, mode="background", timeout_s=10, backoff_s=1, node=link)
        try:
            fetches.background("acme", scope, chains[0])
            assert eventually(lambda: client.stats()["copies"].get("copied") == 4)
            assert eventually(lambda: fetches.handed == 4) and asked == []  # the node made every GET
            assert client.lookup("acme", [b.key for b in chains[0]]).count == 4

            stop(pid, signal.SIGKILL)
            assert gone(pid)
            fetches.background("acme", scope, chains[1])
            assert eventually(lambda: all(store.tiers[0].exists(n) for n in scope.names(chains[1])))
            assert len(asked) >= 4 and fetches.handed == 4  # copied here
        finally:
            fetches.close()
            link.close()
