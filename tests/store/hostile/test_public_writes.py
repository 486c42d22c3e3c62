"""Attacks on the shared ``public`` KV: a tenant replacing what every tenant loads (issue 31, point 1)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from prefill.cli import main
from store.errors import TenantAccessDenied
from store.format.encode import build_snapshot
from store.identity.keys import Block, KeyRoot, block_chain
from store.identity.tenant import PUBLIC, PUBLIC_TENANT, Tenant
from store.serving.loader import KVLoader
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.factories import make_chain, make_root, make_snapshot
from tests.store.pool_workers import TINY, config, prompt, synthetic_prefix

BETA = Tenant.derive("beta", "beta-secret-of-at-least-32-characters")
ACME = Tenant.derive("acme", "acme-secret-of-at-least-32-characters")
BS = 16


def public_store(path: Path) -> tuple[Store, list]:
    """A store whose public namespace the public writer (the prefill job) filled."""
    store = Store([LocalTier(path, cap_bytes=64 << 20)])
    root = make_root(PUBLIC_TENANT)
    chain = make_chain(root, 2)
    for b in chain:
        store.put(PUBLIC_TENANT, make_snapshot(root, b, tenant=PUBLIC_TENANT))
    return store, chain


def test_attack_beta_removes_a_public_snapshot_with_prefill_store_rm_is_refused(tmp_path, capsys, caplog) -> None:
    store, chain = public_store(tmp_path / "nvme")
    store.close()
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text("tenants:\n  beta:\n    secret_env: BETA_SECRET\n")
    url = f"file://{tmp_path / 'nvme'}"

    with caplog.at_level(logging.WARNING, logger="kvwarm.store"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("BETA_SECRET", "beta-secret-of-at-least-32-characters")
        code = main(["store", "--config", str(cfg), "--store", url, "rm", chain[0].key,
                     "--tenant", "beta", "--namespace", "public"])

    out = capsys.readouterr()
    assert code == 1 and "removed" not in out.out
    assert "TenantAccessDenied" in out.err and "only the public writer" in out.err
    assert any("refused" in r.getMessage() for r in caplog.records)  # the refusal is counted and logged
    again = Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)])
    assert again.probe(BETA, chain, make_root(PUBLIC_TENANT)).count == 2  # still there, for every tenant


def test_attack_beta_puts_its_own_kv_under_a_public_key_is_refused_and_counted(tmp_path) -> None:
    store, chain = public_store(tmp_path / "nvme")
    root = make_root(PUBLIC_TENANT)
    forged = make_snapshot(root, chain[0], tenant=PUBLIC_TENANT, seed=99)  # beta's numbers, public's label and key

    with pytest.raises(TenantAccessDenied, match="only the public writer"):
        store.put(BETA, forged)
    with pytest.raises(TenantAccessDenied, match="only the public writer"):
        store.delete(BETA, chain[0].key, namespace=PUBLIC)

    assert store.stats["refused"] == 2
    assert store.get(BETA, chain[0], root) is not None  # reading public stays open to every tenant
    assert len(store.list(BETA, PUBLIC)) == 2


def test_attack_acme_lookup_serves_the_kv_beta_put_under_public_keys_is_prevented(tmp_path) -> None:
    cfg = config(BS, "fp8")
    ids = prompt(3 * BS + 5, seed=31)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    assert synthetic_prefix(store, cfg, ids[: 2 * BS], layers=2, heads=2, head_dim=16, seed=1,
                            tenant=PUBLIC_TENANT) == 2
    precision = cfg.kv_cache.precision()
    root = TINY.key_root(precision, BS, PUBLIC_TENANT.salt)
    written = [store.stat(PUBLIC_TENANT, k.key, PUBLIC)[0].parts for k in make_public_chain(root, ids)]

    # beta removes the public blocks and writes its own KV under the same keys (what worked before)
    for block in make_public_chain(root, ids):
        try:
            store.delete(BETA, block.key, namespace=PUBLIC)
        except TenantAccessDenied:
            pass
    for block in make_public_chain(root, ids):
        g = torch.Generator().manual_seed(666)
        kv = [(torch.randn(2, BS, 16, generator=g), torch.randn(2, BS, 16, generator=g)) for _ in range(2)]
        forged = build_snapshot(root=root, block=block, tenant=PUBLIC, kv=kv, precision=precision,
                                created_at=time.time(), ttl_s=3600)
        try:
            store.put(BETA, forged)
        except TenantAccessDenied:
            pass
    store.close()

    loader = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, config=cfg, pool_bytes=1 << 30, model=TINY,
                      pool_dir=tmp_path / "pool")
    try:
        hit = loader.lookup(ids)
        assert hit is not None and hit.tokens == 2 * BS and all(n.startswith("public/") for n in hit.names)
        assert [s.header.parts for s in hit.snapshots] == written  # the public writer's numbers, not beta's
        hit.release()
        assert loader.store.stats["refused"] == 0
    finally:
        loader.close()


def make_public_chain(root: KeyRoot, ids: list[int]) -> list[Block]:
    return block_chain(root, ids[: 2 * BS])
