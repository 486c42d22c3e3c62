"""The worker role's test setup: a real local store of synthetic snapshots and engine-shaped CPU caches."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from store.config import parse_config
from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import StepPlan
from store.engines.vllm.settings import ConnectorSettings
from store.engines.vllm.validity import Compute
from store.engines.vllm.worker import WorkerRole
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.tiers.store import Store
from tests.store.factories import make_kv, make_snapshot

KB, EB, L, H, D, NB = 32, 16, 2, 2, 8, 64
IDENT = ModelIdentity("test-model@1", "tok-1", name="m")


def cfg(compression: str = "bf16", pool_dir: Path | None = None):
    loader = {"pool_dir": str(pool_dir)} if pool_dir is not None else {}
    return parse_config({"kv_cache": {"block_size": KB, "compression": compression}, "loader": loader})


def tokens(n: int, seed: int = 0) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(1000) for _ in range(n)]


def store_blocks(tmp_path: Path, ids, blocks: int | None = None, compression: str = "bf16") -> list:
    c = cfg(compression)
    tenant = c.tenant("acme")
    root = IDENT.key_root(c.kv_cache.precision(), KB, tenant.salt)
    store = Store.open(f"file://{tmp_path}/nvme", c)
    chain = block_chain(root, ids)[:blocks]
    for i, b in enumerate(chain):
        store.put(tenant, make_snapshot(root, b, tenant=tenant, precision=c.kv_cache.precision(), layers=L,
                                        heads=H, head_dim=D, seed=i))
    store.close()
    return chain


def expected(block: int):
    """Per layer (K, V) of stored block ``block`` as the engine holds them (bf16)."""
    c = cfg()
    root = IDENT.key_root(c.kv_cache.precision(), KB, c.tenant("acme").salt)
    return [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in make_kv(root, layers=L, heads=H, head_dim=D,
                                                                               seed=block)]


def step(worker: WorkerRole, plan: StepPlan) -> None:
    """One engine step as vLLM drives the worker: bind the plan, load, forward, save."""
    worker.begin_step(plan)
    worker.start_load(plan)
    worker.after_forward(plan)


def new(req_id: str, table, start: int, tokens: int) -> Compute:
    """A request first scheduled this step: its whole table, ``start`` tokens already computed."""
    return Compute(req_id, start, tokens, tuple(table), replace=True)


@pytest.fixture()
def worker(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    s = ConnectorSettings(store_url=f"file://{tmp_path}/nvme", tenant="acme", config=cfg(pool_dir=tmp_path / "pool"),
                          model_dir=tmp_path)
    w = WorkerRole(s, identities=(IDENT, None), engine_block=EB)
    caches = [torch.full((NB, H, EB, 2 * D), -3.0, dtype=torch.bfloat16) for _ in range(L)]
    w.register(caches, EngineLayout("cpu_vec", NB, H, EB, D, torch.bfloat16), total_kv_heads=H)
    yield w
    w.close()
