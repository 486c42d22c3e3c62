"""A loader's warm-up pays the first load's one-off costs at start-up, leaves nothing a load could see, and
only logs when it fails."""
from __future__ import annotations

import logging
import random
import threading
from pathlib import Path

import torch

from store.config import parse_config
from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.settings import ConnectorSettings
from store.engines.vllm.worker import WorkerRole
from store.format.header import Layout
from store.format.precision import dequantize, quantize
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.kernels import memory
from store.kernels.table import native_isa
from store.serving.loader import KVLoader
from store.serving.warmup import warm_up
from store.tiers.store import Store
from tests.store.factories import make_kv, make_snapshot

KB, L, H, D, BLOCKS = 64, 4, 4, 64, 8  # a 512-token load: 2 MiB of bf16 output, past memory.RECYCLE_MIN_BYTES
IDENT = ModelIdentity("test-model@1", "tok-1", name="m")
GEOMETRY = Layout(L, H, D, KB)


def _config(tmp_path: Path):
    return parse_config({"kv_cache": {"block_size": KB, "compression": "fp8"},
                         "loader": {"pool_dir": str(tmp_path / "pool")}})


def _ids() -> list[int]:
    g = random.Random(7)
    return [g.randrange(1000) for _ in range(BLOCKS * KB + 1)]


def _stored(tmp_path: Path) -> None:
    c = _config(tmp_path)
    tenant = c.tenant("acme")
    root = IDENT.key_root(c.kv_cache.precision(), KB, tenant.salt)
    store = Store.open(f"file://{tmp_path}/nvme", c)
    for i, b in enumerate(block_chain(root, _ids())):
        store.put(tenant, make_snapshot(root, b, tenant=tenant, precision=c.kv_cache.precision(), layers=L, heads=H,
                                        head_dim=D, seed=i))
    store.close()


def _loader(tmp_path: Path) -> KVLoader:
    c = _config(tmp_path)
    return KVLoader(f"file://{tmp_path}/nvme", tenant="acme", model=IDENT, config=c)


def _expected(tmp_path: Path) -> list[torch.Tensor]:
    """K.0, V.0, ... of the stored chain as the reference arithmetic dequantises it, in bf16."""
    c = _config(tmp_path)
    precision = c.kv_cache.precision()
    root = IDENT.key_root(precision, KB, c.tenant("acme").salt)
    blocks = [make_kv(root, layers=L, heads=H, head_dim=D, seed=i) for i in range(BLOCKS)]
    out = []
    for layer in range(L):
        for kv in (0, 1):
            parts = [dequantize(*quantize(b[layer][kv], precision, layer), torch.bfloat16) for b in blocks]
            out.append(torch.cat(parts, dim=1))
    return out


def _loads_the_stored_kv(loader: KVLoader, tmp_path: Path) -> None:
    hit = loader.lookup(_ids())
    assert hit is not None and hit.tokens == BLOCKS * KB
    with hit:
        got = hit.dequantized(torch.bfloat16, tokens=BLOCKS * KB)
    for g, want in zip(got, _expected(tmp_path), strict=True):
        assert torch.equal(g, want)


def _trace(loader: KVLoader) -> dict:
    """What a load could see of the pool and the loader: the loader's stats (its counters, the pool's bytes in
    use and pinned, what this process maps), the pool's eviction epoch and the admissions it holds."""
    stats = loader.stats()
    return {**stats, "epoch": loader.pool.epoch(), "admissions": loader.pool.admissions(
        [f"k{i}" for i in range(4)]), "metrics": loader.metrics.as_dict()}


def test_a_warm_up_leaves_no_trace_a_load_could_see_and_the_load_is_the_stored_kv(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    _stored(tmp_path)
    with _loader(tmp_path) as loader:
        before = _trace(loader)
        held = memory.cached_bytes()
        assert warm_up(loader, GEOMETRY, torch.bfloat16, tokens=BLOCKS * KB)
        assert _trace(loader) == before
        assert before["pool_bytes_in_use"] == before["pool_pinned_bytes"] == before["mapped_here"] == 0
        if native_isa() is not None and memory._ENABLED:  # the gather's output memory is kept for the first load
            assert memory.cached_bytes() >= held + 2 * L * H * BLOCKS * KB * D * 2
        _loads_the_stored_kv(loader, tmp_path)  # into memory the warm-up wrote: every element is the load's


def test_a_warm_up_that_fails_is_logged_and_the_loader_still_loads(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    _stored(tmp_path)
    with _loader(tmp_path) as loader, caplog.at_level(logging.WARNING, logger="kvwarm.loader"):
        assert not warm_up(loader, Layout(L, H, D, 2 * KB), torch.bfloat16, tokens=KB)  # not the store's blocks
        assert not warm_up(loader, GEOMETRY, torch.bfloat16, layers=[L], tokens=KB)  # a layer the model lacks
        assert [r.message.startswith("kvwarm: the loader's warm-up failed") for r in caplog.records] == [True, True]
        _loads_the_stored_kv(loader, tmp_path)


def test_a_warm_up_where_the_pool_directory_is_unusable_is_logged_and_the_loader_still_loads(
        tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    _stored(tmp_path)
    with _loader(tmp_path) as loader, caplog.at_level(logging.WARNING, logger="kvwarm.loader"):
        pool_db = tmp_path / "pool" / "pool.sqlite"
        pool_db.rename(tmp_path / "pool.sqlite.moved")  # this thread's connection follows it; a new one cannot
        pool_db.mkdir()
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(warm_up(loader, GEOMETRY, torch.bfloat16, tokens=KB)))
        t.start()
        t.join()
        assert done == [False]
        assert any(r.message.startswith("kvwarm: the loader's warm-up failed") for r in caplog.records)
        _loads_the_stored_kv(loader, tmp_path)


def test_a_worker_warms_its_loaders_at_register_without_touching_the_engines_caches(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    _stored(tmp_path)
    s = ConnectorSettings(store_url=f"file://{tmp_path}/nvme", tenant="acme", config=_config(tmp_path),
                          model_dir=tmp_path, write_back=False)
    w = WorkerRole(s, identities=(IDENT, None), engine_block=KB // 2)
    caches = [torch.full((32, H, KB // 2, 2 * D), -3.0, dtype=torch.bfloat16) for _ in range(L)]
    try:
        w.register(caches, EngineLayout("cpu_vec", 32, H, KB // 2, D, torch.bfloat16), total_kv_heads=H)
        assert all(bool((c == -3.0).all()) for c in caches)
        loader = w.loader("acme", False)
        stats = loader.stats()
        assert stats["pool_bytes_in_use"] == stats["pool_pinned_bytes"] == stats["mapped_here"] == 0
        assert stats["lookups"] == 0
        _loads_the_stored_kv(loader, tmp_path)
    finally:
        w.close()
