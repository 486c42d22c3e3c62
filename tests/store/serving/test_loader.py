"""KVLoader with a real (tiny) transformers model: lookup, DynamicCache, generate, metrics, prefetch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from prometheus_client import generate_latest

from store.identity.fingerprint import identity_from_dir
from store.plan import plan_from_prefixes
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.pool_workers import ACME, TINY, config, prompt, tiny_model, write_prefix

BS = 16


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_model(torch.bfloat16)


def make_loader(tmp_path, cfg, **kw) -> KVLoader:
    kw.setdefault("pool_bytes", 1 << 30)
    kw.setdefault("model", TINY)
    kw.setdefault("pool_dir", tmp_path / "pool")
    return KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, config=cfg, **kw)


def write(tmp_path, cfg, model, ids) -> int:
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    try:
        return write_prefix(store, cfg, model, ids)
    finally:
        store.close()


def generate(model, ids, cache=None, n=6) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_bf16_snapshots_generate_the_same_tokens_as_a_cold_run(tmp_path, bf16_model):
    model, mcfg = bf16_model
    cfg = config(BS, "bf16")
    ids = prompt(4 * BS + 9, seed=10)
    assert write(tmp_path, cfg, model, ids[: 3 * BS]) == 3
    loader = make_loader(tmp_path, cfg, model_config=mcfg)

    hit = loader.lookup(ids)

    assert hit is not None and hit.tokens == 3 * BS and hit.usable_tokens == 3 * BS and hit.tier == "nvme"
    with hit:
        cache = hit.to_dynamic_cache("cpu", torch.bfloat16)
    assert cache.get_seq_length() == 3 * BS
    assert generate(model, ids, cache) == generate(model, ids)
    loader.close()


def test_a_hit_covering_the_whole_prompt_leaves_one_token_to_compute(tmp_path, bf16_model):
    model, mcfg = bf16_model
    cfg = config(BS, "bf16")
    ids = prompt(2 * BS, seed=11)
    write(tmp_path, cfg, model, ids)
    loader = make_loader(tmp_path, cfg, model_config=mcfg)
    hit = loader.lookup(ids)
    assert hit.tokens == 2 * BS and hit.usable_tokens == 2 * BS - 1
    cache = hit.to_dynamic_cache("cpu", torch.bfloat16)
    hit.release()
    assert cache.get_seq_length() == 2 * BS - 1
    assert generate(model, ids, cache) == generate(model, ids)
    # the plain forward pass on what the cache does not cover gives the cold logits
    cache = loader.lookup(ids).to_dynamic_cache("cpu", torch.bfloat16)
    with torch.no_grad():
        warm = model(torch.tensor([ids[2 * BS - 1:]]), cache=cache).logits[0, -1]
        cold = model(torch.tensor([ids])).logits[0, -1]
    assert torch.equal(warm, cold)
    loader.close()


def test_fp8_snapshots_agree_with_a_cold_run_within_tolerance(tmp_path):
    model, mcfg = tiny_model(torch.float32)
    cfg = config(BS, "fp8")
    ids = prompt(4 * BS + 5, seed=12)
    write(tmp_path, cfg, model, ids[: 4 * BS])
    loader = make_loader(tmp_path, cfg, model_config=mcfg)
    hit = loader.lookup(ids)
    assert hit.tokens == 4 * BS
    cache = hit.to_dynamic_cache("cpu", torch.float32)
    with torch.no_grad():
        warm = torch.log_softmax(model(torch.tensor([ids[4 * BS:]]), cache=cache).logits[0, -1], -1)
        cold = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    assert float((warm - cold).norm() / cold.norm()) < 0.02
    assert int(warm.argmax()) == int(cold.argmax())
    loader.close()


def test_model_given_as_a_directory(tmp_path, bf16_model):
    model, _ = bf16_model
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "bytes"}}))
    ident = identity_from_dir(model_dir)
    cfg = config(BS, "bf16")
    ids = prompt(2 * BS + 1, seed=13)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    write_prefix(store, cfg, model, ids[: 2 * BS], identity=ident)
    store.close()

    loader = make_loader(tmp_path, cfg, model=model_dir)  # fingerprinted from files, config read lazily
    hit = loader.lookup(ids)
    assert hit is not None and hit.tokens == 2 * BS
    cache = hit.to_dynamic_cache("cpu", torch.bfloat16)  # no model_config given: from config.json
    assert generate(model, ids, cache) == generate(model, ids)
    loader.close()


def test_misses_short_prompts_and_unknown_prefixes_and_counts_them(tmp_path, bf16_model):
    model, _ = bf16_model
    cfg = config(BS, "bf16")
    write(tmp_path, cfg, model, prompt(2 * BS, seed=14))
    loader = make_loader(tmp_path, cfg)
    assert loader.lookup(prompt(BS - 1, seed=14)) is None
    assert loader.lookup(prompt(3 * BS, seed=99)) is None
    assert loader.lookup(torch.tensor([prompt(2 * BS + 1, seed=14)])) is not None  # a [1, n] tensor is fine
    with pytest.raises(ValueError):
        loader.lookup([-1] * 40)  # a programming error, not a store failure
    stats = loader.stats()
    assert stats["lookups"] == 3 and stats["hits"] == 1 and stats["tokens_served"] == 2 * BS
    assert stats["misses_by_reason"] == {"short_prompt": 1, "absent": 1}
    assert stats["pool_bytes_in_use"] > 0 and stats["latency"]["lookup"]["count"] == 3
    text = generate_latest(loader.metrics.registry).decode()
    assert 'kvwarm_loader_lookups_total{tenant="acme"} 3.0' in text
    assert 'kvwarm_loader_misses_total{reason="short_prompt",tenant="acme"} 1.0' in text
    assert "kvwarm_pool_bytes_in_use" in text and "kvwarm_loader_load_seconds_bucket" in text
    # a second loader in the same process has its own registry: no collision
    other = make_loader(tmp_path, cfg)
    assert other.stats()["lookups"] == 0
    other.close()
    loader.close()


def test_prefetch_maps_ahead_and_plan_scores_decide_retention(tmp_path, bf16_model):
    model, _ = bf16_model
    cfg = config(BS, "bf16")
    a, b, c = (prompt(2 * BS, seed=s) for s in (20, 21, 22))
    for ids in (a, b, c):
        write(tmp_path, cfg, model, ids)
    probe = make_loader(tmp_path, cfg)
    size = sum(probe.local.path(n).stat().st_size for n in probe._own.names(probe.lookup(a + [1]).blocks))
    probe.close()
    # room for two of the three prefixes
    loader = make_loader(tmp_path, cfg, pool_bytes=2 * size + size // 2, pool_dir=tmp_path / "pool2")

    result = loader.prefetch(plan_from_prefixes("acme", [a])).result(timeout=HANG_S)  # a: forecast to be reused
    assert result.mapped == 2 and result.present == 2 and not result.failed
    assert loader.pool.usage() == size
    hit = loader.lookup(a + [1])
    assert hit.tier == "pool"  # mapped ahead: the lookup maps nothing new
    hit.release()
    loader.lookup(b + [1]).release()  # b is now more recent than a
    loader.lookup(c + [1]).release()  # needs room: b goes (unscored), not a (scored), though a is older
    held = loader.pool.admissions(loader._own.names(loader.lookup(a + [1]).blocks))
    assert len(held) == 2
    assert len(loader.pool.admissions(loader._own.names(probe_blocks(loader, b)))) < 2  # b gave up the room
    loader.close()


def probe_blocks(loader, ids):
    from store.identity.keys import block_chain

    return block_chain(loader.root, ids)


def test_the_loader_does_not_import_transformers_prefect_or_statsmodels():
    code = ("import sys, store.serving.loader, store.serving.pool, store.kernels.dequant, store.engines.paged, store.serving.metrics; "
            "bad = [m for m in ('transformers', 'prefect', 'statsmodels', 'prefill', 'flows') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_config_loader_section_supplies_defaults_and_keywords_override(tmp_path):
    from store.config import parse_config

    cfg = parse_config({"kv_cache": {"block_size": 16},
                        "loader": {"pool_bytes": "64MiB", "fetch_mode": "sync", "sync_fetch_timeout_s": 0.25,
                                   "pool_dir": str(tmp_path / "cfgpool")}})
    with KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=cfg) as loader:
        assert loader.fetch_mode == "sync" and loader.sync_fetch_timeout_s == 0.25
        assert loader.stats()["pool_budget_bytes"] == 64 << 20
    with KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=cfg, fetch_mode="background",
                  pool_dir=tmp_path / "pool2") as loader:
        assert loader.fetch_mode == "background"


def test_a_public_prefix_serves_every_tenant_from_one_pooled_copy_and_their_own_longer_chain_wins(tmp_path, bf16_model):
    from store.config import parse_config
    from store.identity.tenant import PUBLIC_TENANT, Tenant

    model, mcfg = bf16_model
    cfg = config(BS, "bf16")
    system = prompt(3 * BS, seed=21)  # a shared system prompt, prefilled for everyone
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    assert write_prefix(store, cfg, model, system, tenant=PUBLIC_TENANT) == 3
    store.close()
    ids = system + prompt(BS + 5, seed=22)
    loader = make_loader(tmp_path, cfg, model_config=mcfg)
    hit = loader.lookup(ids)
    assert hit is not None and hit.tokens == 3 * BS and all(n.startswith("public/") for n in hit.names)
    with hit:
        cache = hit.to_dynamic_cache("cpu", torch.bfloat16)
    assert generate(model, ids, cache) == generate(model, ids)

    other = Tenant.derive("globex", "globex-secret")
    loader2 = KVLoader(f"file://{tmp_path}/nvme", tenant=other, config=cfg, pool_bytes=1 << 30, model=TINY,
                       pool_dir=tmp_path / "pool", model_config=mcfg)
    hit2 = loader2.lookup(ids)
    assert hit2 is not None and hit2.names == hit.names  # the same pooled snapshots
    hit2.release()

    # the tenant's own chain, once longer, is what it gets
    assert write(tmp_path, cfg, model, ids[: 4 * BS]) == 4
    own = loader.lookup(ids)
    assert own is not None and own.tokens == 4 * BS and all(n.startswith("acme/") for n in own.names)
    own.release()

    # and operators can turn public prefixes off
    off = parse_config({"kv_cache": {"block_size": BS, "compression": "bf16"}, "loader": {"public_prefixes": False}})
    loader3 = KVLoader(f"file://{tmp_path}/nvme", tenant=other, config=off, pool_bytes=1 << 30, model=TINY,
                       pool_dir=tmp_path / "pool", model_config=mcfg)
    assert loader3.lookup(ids) is None
    for ld in (loader, loader2, loader3):
        ld.close()


def test_a_day_of_plans_keeps_one_plans_priorities(tmp_path):
    """Re-prefetching a new plan every five minutes for a day: the loader holds the latest plan's scores only."""
    from store.plan import Plan, PlanEntry

    loader = make_loader(tmp_path, config(BS, "bf16"))
    for i in range(288):
        entries = [PlanEntry("acme", token_ids=tuple(prompt(2 * BS, seed=1000 * i + j)), score=float(j))
                   for j in range(10)]
        loader.prefetch(Plan(entries=tuple(entries)), map_ahead=False).result(timeout=HANG_S)
    assert len(loader.mapper.priority) == 20  # 10 prefixes of 2 blocks: the last plan's
    loader.prefetch([prompt(2 * BS, seed=7)], map_ahead=False).result(timeout=HANG_S)  # bare prefixes keep them
    assert len(loader.mapper.priority) == 20
    loader.close()
