"""The worker role of each parallel layout over a real local store: a pipeline stage loads its own (global)
layers, a tensor-parallel rank its own KV heads, bit for bit, reading only its share; neither writes back.

The layer names are vLLM's (``model.layers.N.self_attn.attn``), ordered and checked by
:func:`store.engines.vllm.parallel.order_layers` as the connector does (the connector reads
the indices with vLLM's own ``extract_layer_index``: tests/store/engines/vllm/test_engine_env.py).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import store.kernels.table
from store.config import parse_config
from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import LoadSpec, StepPlan
from store.engines.vllm.paging import read_layer
from store.engines.vllm.parallel import order_layers
from store.engines.vllm.settings import ConnectorSettings
from store.engines.vllm.worker import WorkerRole
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.kernels.table import native_isa
from store.tiers.store import Store
from tests.store.factories import make_snapshot
from tests.store.kernels.recorder import Recorder, head_offsets, stored_fp8

KB, EB, L, H, D, NB = 32, 16, 4, 4, 8, 16
IDENT = ModelIdentity("test-model@1", "tok-1", name="m")
NAMES = {f"model.layers.{i}.self_attn.attn": i for i in range(L)}


def cfg(compression: str, pool_dir: Path | None = None):
    loader = {"pool_dir": str(pool_dir)} if pool_dir is not None else {}
    return parse_config({"kv_cache": {"block_size": KB, "compression": compression}, "loader": loader})


def stored(tmp_path: Path, compression: str, n: int) -> tuple[list[int], list]:
    """``n`` blocks of a prompt stored for acme (L layers, H heads); the prompt and the snapshots read back."""
    c = cfg(compression)
    tenant = c.tenant("acme")
    root = IDENT.key_root(c.kv_cache.precision(), KB, tenant.salt)
    g = random.Random(n)
    ids = [g.randrange(1000) for _ in range(n * KB + 1)]
    store = Store.open(f"file://{tmp_path}/nvme", c)
    chain = block_chain(root, ids)[:n]
    for i, b in enumerate(chain):
        store.put(tenant, make_snapshot(root, b, tenant=tenant, precision=c.kv_cache.precision(), layers=L, heads=H,
                                        head_dim=D, seed=i))
    snaps = [store.get(tenant, b, root) for b in chain]
    store.close()
    return ids, snaps


def want(snaps, layer: int, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` over the stored blocks, dequantised by the reference, ``heads`` only."""
    kv = [s.layer(layer, torch.bfloat16) for s in snaps]
    return torch.cat([k for k, _ in kv], dim=1)[heads], torch.cat([v for _, v in kv], dim=1)[heads]


def worker(tmp_path: Path, compression: str, *, names: dict[str, int], tp_rank: int = 0, tp_size: int = 1,
           write_back: bool = True) -> WorkerRole:
    """A worker holding the layers ``names`` lists (in vLLM's registration order) and its rank's heads."""
    s = ConnectorSettings(store_url=f"file://{tmp_path}/nvme", tenant="acme", write_back=write_back,
                          config=cfg(compression, tmp_path / "pool"), model_dir=tmp_path)
    w = WorkerRole(s, identities=(IDENT, None), engine_block=EB, tp_rank=tp_rank, tp_size=tp_size)
    order, layers = order_layers(names, model="m", total_layers=L, stage=(min(names.values()), max(names.values()) + 1),
                                 group_layers=list(names))
    heads = H // tp_size
    caches = [torch.full((NB, heads, EB, 2 * D), -3.0, dtype=torch.bfloat16) for _ in order]
    w.register(caches, EngineLayout("cpu_vec", NB, heads, EB, D, torch.bfloat16), total_kv_heads=H, layers=layers,
               total_layers=L)
    return w


def load(w: WorkerRole, ids: list[int], n: int) -> tuple[int, ...]:
    table = tuple(range(3, 3 + n * KB // EB))
    w.start_load(StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: n * KB]), 0, n * KB, table),)))
    assert w.take_failed() == set()
    (result,) = w.take_report().loads
    assert result.loaded == n * KB and result.reason is None
    return table


@pytest.mark.parametrize("compression", ["bf16", "fp8"])
def test_a_pipeline_stage_loads_its_own_global_layers_and_does_not_write_back(tmp_path, monkeypatch, compression):
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    ids, snaps = stored(tmp_path, compression, 2)
    # the second stage of two: layers 2 and 3 of 4, registered in an order vLLM does not promise
    stage = {"model.layers.3.self_attn.attn": 3, "model.layers.2.self_attn.attn": 2}
    w = worker(tmp_path, compression, names=stage)
    try:
        assert w.writer is None  # a stage holds half a model: a snapshot needs every layer
        table = load(w, ids, 2)
        for cache, layer in zip(w.caches, (2, 3)):
            k, v = read_layer(cache, w.layout, list(table))
            wk, wv = want(snaps, layer, slice(None))
            assert torch.equal(k, wk) and torch.equal(v, wv), f"snapshot layer {layer} is not in its cache"
    finally:
        w.close()


def test_without_pipeline_parallel_every_layer_loads_in_order_and_writes_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    ids, snaps = stored(tmp_path, "fp8", 1)
    w = worker(tmp_path, "fp8", names=dict(reversed(list(NAMES.items()))))
    try:
        assert w.writer is not None
        table = load(w, ids, 1)
        for layer, cache in enumerate(w.caches):
            k, v = read_layer(cache, w.layout, list(table))
            wk, wv = want(snaps, layer, slice(None))
            assert torch.equal(k, wk) and torch.equal(v, wv)
    finally:
        w.close()


@pytest.mark.skipif(native_isa() is None, reason="native gather not built")
@pytest.mark.parametrize("compression", ["bf16", "fp8"])
def test_each_tensor_parallel_rank_gets_exactly_its_heads_and_reads_only_them(tmp_path, monkeypatch, compression):
    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    ids, snaps = stored(tmp_path, compression, 2)
    layout = snaps[0].payload[1]
    for rank, heads in ((0, slice(0, 2)), (1, slice(2, 4))):
        rec = Recorder(store.kernels.table._native)
        monkeypatch.setattr(store.kernels.table, "_native", rec)
        w = worker(tmp_path, compression, names=NAMES, tp_rank=rank, tp_size=2)
        try:
            assert w.writer is None  # no rank holds every head
            warmed = sorted(rec.fp8_offsets()), sorted(rec.copy_offsets())  # register's warm-up: this rank's share
            rec.fp8_jobs.clear()
            rec.copy_jobs.clear()
            table = load(w, ids, 2)
            for layer, cache in enumerate(w.caches):
                k, v = read_layer(cache, w.layout, list(table))
                wk, wv = want(snaps, layer, heads)
                assert torch.equal(k, wk) and torch.equal(v, wv), f"rank {rank}, layer {layer}"
            # what was handed to the dequantiser: this rank's heads of every layer, nothing of the other's
            held = range(heads.start, heads.stop)
            fp8 = stored_fp8(layout, range(L))
            assert sorted(rec.fp8_offsets()) == sorted(head_offsets(layout, fp8, held))
            kept = [i for i in range(L) if i not in fp8]
            assert sorted(rec.copy_offsets()) == sorted(head_offsets(layout, kept, held))
            assert warmed == (sorted(rec.fp8_offsets()), sorted(rec.copy_offsets()))
        finally:
            w.close()
            monkeypatch.setattr(store.kernels.table, "_native", rec._native)
