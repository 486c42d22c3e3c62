"""The connector's CUDA paths, on a GPU only (bench/gpu_check.sh runs this file where one is lent).

The same checks as the CPU tests, with the caches on the device: a load arrives layer by layer
on the loader thread's load stream and the forward's stream waits on its events; staging goes
through bounded pinned slots in pieces; write-back copies blocks on its save stream, after the
forward's stream, into pinned host memory and the writer waits for their event. Each compares
bytes with the CPU path's. The fence checks hold the stream that must be waited for behind a
device sleep (``torch.cuda._sleep``): without the fence the reader sees the old bytes.
"""
from __future__ import annotations

import pytest
import torch

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import LoadSpec, SaveSpec, StepPlan
from store.engines.vllm.paging import read_layer, take_blocks, write_layer
from store.engines.vllm.streams import DeviceStreams
from store.kernels.staging import SLOTS, Staging, gather_to_device
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.worker_setup import EB, KB, NB, D, H, L, expected, new, store_blocks, tokens

#: Device cycles a stream sleeps so that a missing fence shows (tens of milliseconds on an H100).
SLEEP_CYCLES = 100_000_000

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


def _gpu_worker(tmp_path, monkeypatch):
    """A real worker role registered on zeroed CUDA caches (split layout) over the test's NVMe tier."""
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
    return w, caches, layout


def test_a_load_into_gpu_caches_layer_by_layer_and_its_write_back(tmp_path, monkeypatch) -> None:

    w, caches, layout = _gpu_worker(tmp_path, monkeypatch)
    assert isinstance(w.fences.streams, DeviceStreams) and w.fences.thread is not None
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


def test_device_streams_order_work_across_streams_by_events_only() -> None:
    streams = DeviceStreams("cuda")
    side = streams.new_stream("load")
    x = torch.zeros(1 << 20, device="cuda")
    compute = streams.current()
    with side.use():
        assert torch.cuda.current_stream() != torch.cuda.default_stream()  # issued on the side stream
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
        filled = streams.record("filled", side)
    assert streams.current().raw == compute.raw  # back on the compute stream
    compute.wait_event(filled)
    assert float(x.sum()) == x.numel()  # the compute stream read after the side stream's write
    side.wait_stream(compute)
    side.synchronize()


def test_write_back_copies_wait_for_the_forwards_stream(tmp_path, monkeypatch) -> None:
    """The forward's stream writes a block's KV behind a sleep; the save stream's copy must see it."""
    from store.identity.keys import block_chain
    from store.tiers.store import Store
    from tests.store.engines.vllm.worker_setup import IDENT, cfg

    w, caches, layout = _gpu_worker(tmp_path, monkeypatch)
    try:
        ids = tokens(KB + 1, seed=31)
        plan = StepPlan(saves=(SaveSpec("r", "acme", False, 0, tuple(ids[:KB]), (7, 8)),),
                        computes=(new("r", (7, 8), 0, KB),))
        w.begin_step(plan)
        w.start_load(plan)
        torch.cuda._sleep(SLEEP_CYCLES)  # "the forward", on the compute stream
        for layer in range(L):
            k, v = expected(0)[layer]
            write_layer(caches[layer], layout, [7, 8], k.cuda(), v.cuda())
        w.after_forward(plan)
        assert w.writer.drain(HANG_S) and w.counters.totals()["written_back_blocks"] == 1
        c = cfg()
        tenant = c.tenant("acme")
        root = IDENT.key_root(c.kv_cache.precision(), KB, tenant.salt)
        store = Store.open(f"file://{tmp_path}/nvme", c)
        snap = store.get(tenant, block_chain(root, ids)[0], root)
        assert snap is not None
        for layer in range(L):
            k, v = snap.layer(layer, torch.bfloat16)
            assert torch.equal(k, expected(0)[layer][0]) and torch.equal(v, expected(0)[layer][1])
        store.close()
    finally:
        w.close()


def test_a_load_waits_for_what_the_compute_stream_queued_before_the_step(tmp_path, monkeypatch) -> None:
    """The compute stream writes the load's blocks behind a sleep (as vLLM may zero a block it allocated); the
    load stream's writes must land after them."""

    w, caches, layout = _gpu_worker(tmp_path, monkeypatch)
    try:
        ids = tokens(2 * KB + 1, seed=32)
        store_blocks(tmp_path, ids)
        plan = StepPlan(loads=(LoadSpec("r", "acme", False, tuple(ids[: 2 * KB]), 0, 2 * KB, (1, 2, 3, 4)),),
                        computes=(new("r", (1, 2, 3, 4, 5), 2 * KB, 1),))
        torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy ...
        for cache in caches:
            cache[[1, 2, 3, 4]] = 7.0  # ... and then writes the blocks the load is given
        w.begin_step(plan)
        w.start_load(plan)
        for layer in range(L):
            w.wait_layer(layer)
            k, v = read_layer(caches[layer], layout, [1, 2, 3, 4])
            want_k = torch.cat([expected(b)[layer][0] for b in (0, 1)], dim=1)
            want_v = torch.cat([expected(b)[layer][1] for b in (0, 1)], dim=1)
            assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)
        assert w.take_failed() == set()
    finally:
        w.close()
