"""The pool mapper's reads: a snapshot entering the node's pool is checked and read ahead; one already
pooled (mapped by another process, or by an engine before its restart) is neither.

The second loader stands for a restarted engine: a new mapper over the same pool, whose entries the
first one admitted. The store is real (a local tier on disk, a real pool); the spy only records the
keywords each read was asked with and passes the call through.
"""
from __future__ import annotations

from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.store.pool_workers import ACME, TINY, config, prompt, synthetic_prefix

BS = 16


def test_reads_ahead_and_checks_only_what_enters_the_pool(tmp_path, monkeypatch):
    cfg = config(BS, "fp8")
    ids = prompt(4 * BS + 3)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    assert synthetic_prefix(store, cfg, ids, layers=2, heads=2, head_dim=16) == 4
    store.close()
    asked: list[tuple[bool, bool]] = []
    real = Store.read

    def spy(self, tenant, block, root, **kw):  # type: ignore[no-untyped-def]
        asked.append((kw.get("verify", True), kw.get("readahead", False)))
        return real(self, tenant, block, root, **kw)

    monkeypatch.setattr(Store, "read", spy)

    def load() -> int:
        with KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=cfg, pool_dir=tmp_path / "pool",
                      pool_bytes=1 << 30, node=None) as ld:
            hit = ld.lookup(ids)
            assert hit is not None
            with hit:
                return hit.tokens

    assert load() == 4 * BS
    assert asked == [(True, True)] * 4  # none pooled: each checked and read ahead as it enters
    asked.clear()
    assert load() == 4 * BS  # a new mapper (a restarted engine): the pool holds all four
    assert asked == [(False, False)] * 4
