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
