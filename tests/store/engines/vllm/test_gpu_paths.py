"""The connector's CUDA paths, on a GPU only (bench/gpu_check.sh runs this file where one is lent).

The same checks as the CPU tests, with the caches on the device: a load arrives layer by layer
on the loader thread's side stream and the forward's stream waits on its events; staging goes
through bounded pinned slots in pieces; write-back copies blocks into pinned host memory and
the writer waits for their event. Each compares bytes with the CPU path's.
"""
from __future__ import annotations

import pytest
import torch

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from store.engines.vllm.paging import read_layer, take_blocks
from store.kernels.staging import SLOTS, Staging, gather_to_device
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.worker_setup import EB, KB, NB, D, H, L, expected, new, store_blocks, tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)")


def test_staging_to_the_gpu_in_pieces_through_pinned_slots() -> None:
    raw = [torch.randint(0, 255, (8, 64, 32), dtype=torch.uint8) for _ in range(40)]
    staging = Staging(max_bytes=SLOTS * 4 * 8 * 64 * 32)  # four parts a piece: ten pieces
    got = gather_to_device(raw, torch.device("cuda"), staging)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), torch.stack(raw)) and staging.allocations == SLOTS
    assert all(s.buf is None or s.buf.is_pinned() for s in staging._slots)


def test_write_back_blocks_go_to_pinned_host_memory() -> None:
    cache = torch.randn(NB, H, EB, 2 * D, device="cuda").to(torch.bfloat16)
    layout = EngineLayout("split", NB, H, EB, D, torch.bfloat16)
    ids = [5, 6, 7, 2, 9]
    host = take_blocks(cache, layout, ids, host=True)
    torch.cuda.current_stream().synchronize()
    assert host.is_pinned() and torch.equal(host, cache[ids].cpu())


def test_a_load_into_gpu_caches_layer_by_layer_and_its_write_back(tmp_path, monkeypatch) -> None:
    from store.engines.vllm.settings import ConnectorSettings
    from store.engines.vllm.worker import WorkerRole
    from tests.store.engines.vllm.worker_setup import IDENT, cfg

    monkeypatch.setenv("KVWARM_HOME", str(tmp_path / "home"))
    s = ConnectorSettings(store_url=f"file://{tmp_path}/nvme", tenant="acme", config=cfg(pool_dir=tmp_path / "pool"),
                          model_dir=tmp_path)
    w = WorkerRole(s, identities=(IDENT, None), engine_block=EB)
    caches = [torch.zeros(NB, H, EB, 2 * D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    layout = EngineLayout("split", NB, H, EB, D, torch.bfloat16)
    w.register(caches, layout, total_kv_heads=H)
    try:
        ids = tokens(2 * KB + 1, seed=30)
        store_blocks(tmp_path, ids)
        plan = StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (1, 2, 3, 4)),),
                        computes=(new("r", (1, 2, 3, 4, 5), 2 * KB, 1),))
        w.begin_step(plan)
        w.start_load(plan)
        for layer in range(L):
            w.wait_layer(layer)  # the current stream waits for the layer's event
            k, v = read_layer(caches[layer], layout, [1, 2, 3, 4])
            want_k = torch.cat([expected(b)[layer][0] for b in (0, 1)], dim=1)
            want_v = torch.cat([expected(b)[layer][1] for b in (0, 1)], dim=1)
            assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)
        w.after_forward(StepPlan(saves=(SaveSpec("r", "acme", False, 0, tuple(ids[: 2 * KB]), (1, 2, 3, 4)),)))
        assert w.take_failed() == set() and w.writer.drain(HANG_S)
        assert w.counters.totals().get("write_back_skipped:present") == 2  # read back through pinned memory
    finally:
        w.close()


def test_the_batched_kernels_on_the_gpu_give_the_cpu_bits() -> None:
    from store.format.precision import Precision
    from store.kernels.gather import block_ids, gather_quantise
    from store.kernels.scatter import dequantise_scatter

    cache = (torch.randn(NB, EB, H, 2 * D) * 3).to(torch.bfloat16).transpose(1, 2)  # CUDA's NHD strides
    layout = EngineLayout("split", NB, H, EB, D, torch.bfloat16)
    ids = [9, 2, 5, 0, 7, 3]
    for precision in (Precision(), Precision(granularity="head_group", group_tokens=8)):
        want = gather_quantise(cache, layout, block_ids(ids, "cpu"), ratio=KB // EB, precision=precision, layer=0)
        got = gather_quantise(cache.cuda(), layout, block_ids(ids, "cuda"), ratio=KB // EB, precision=precision,
                              layer=0).to_host()
        torch.cuda.synchronize()
        assert torch.equal(got.k.view(torch.uint8), want.k.view(torch.uint8))
        assert torch.equal(got.v.view(torch.uint8), want.v.view(torch.uint8))
        assert torch.equal(got.k_scale, want.k_scale) and torch.equal(got.v_scale, want.v_scale)
        assert torch.allclose(got.errors, want.errors, rtol=1e-5, atol=0)  # CUDA's reductions: not the same sums
        host, dev = cache.clone(), cache.cuda()
        for target, where in ((host, "cpu"), (dev, "cuda")):
            dequantise_scatter(target, layout, block_ids(ids[::-1], where), k=want.k.to(where), v=want.v.to(where),
                               k_scale=want.k_scale.to(where), v_scale=want.v_scale.to(where),
                               group_tokens=precision.group_tokens)
        assert torch.equal(dev.cpu(), host)
