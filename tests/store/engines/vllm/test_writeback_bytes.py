"""Write-back's batched kernels write the very files the per-block path wrote, byte for byte.

The same engine caches (random KV, every CPU-testable layout, bf16/fp16/fp32) go through
:class:`store.engines.vllm.writeback.WriteBack` (one gather and quantise per layer for a step's saves)
and through the path it replaced (:mod:`bench.lib.old_writeback`); every file on NVMe
equals the old snapshot's bytes, header (scales' checksums, the measured errors) and payload alike.

An fp32 engine cache is the exception, in the last bits of the recorded error only: the old path
handed ``build_snapshot`` each block as a strided slice of the save's KV, and ``relative_error`` of a
strided fp32 tensor (``Tensor.to`` makes no copy of it) sums ``||x||`` in another order, so the old
error of a block depended on its neighbours. The kernel's is the error of the block alone, as
``build_snapshot`` records it for a contiguous block; for fp32 the payloads and every other header field
are compared exactly and the errors to 1e-6 (tests/store/kernels/test_gather.py checks them exactly
against the codec).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench.lib.old_writeback import old_snapshots
from store.engines.vllm.metadata import SaveSpec
from store.engines.vllm.stats import Counters
from store.engines.vllm.tenancy import TenantBook
from store.engines.vllm.writeback import WriteBack
from store.errors import ConfigError
from store.format.encode import snapshot_bytes
from store.format.precision import Precision
from store.format.snapshot import read_snapshot
from store.identity.keys import block_chain
from store.kernels.reservation import Reservation
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.worker_setup import EB, IDENT, KB, NB, D, H, cfg, tokens
from tests.store.kernels.chunking import save_reservation
from tests.store.kernels.engine_caches import layout, random_cache

LAYERS = 3
RATIO = KB // EB
NOW = 1_700_000_000.0
PRECISIONS = {
    "fp8-head": Precision(),
    "fp8-group": Precision(granularity="head_group", group_tokens=12),
    "fp8-keep": Precision(keep_layers=(1,), keep_dtype="fp16"),
    "bf16": Precision(compression="bf16"),
}


@pytest.mark.parametrize("on_writer", [True, False], ids=["quantised_on_writer", "quantised_where_cache_lives"])
@pytest.mark.parametrize("kind", ["cpu_vec", "cpu_permuted", "split"])
@pytest.mark.parametrize("name", list(PRECISIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_steps_saves_are_written_byte_for_byte_as_before(tmp_path, kind: str, name: str, dtype,
                                                           on_writer: bool) -> None:
    """Either place the quantise runs (a CPU cache's writer thread; a GPU's device, here the CPU, in chunks of
    two blocks of a small reservation: a chunk boundary inside request a's blocks and one across the two
    requests) writes the bytes the old per-block path wrote."""
    precision = PRECISIONS[name]
    lay = layout(kind, blocks=NB, heads=H, block=EB, dim=D, dtype=dtype, seed=3)
    caches = [random_cache(lay, seed=10 + i) for i in range(LAYERS)]
    c = cfg()
    book = TenantBook(c, "acme")
    writer = WriteBack(Store([LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)]), book, (IDENT, None), precision,
                       kv_block=KB, ttl_s=3600.0, layout=lay, counters=Counters(), clock=lambda: NOW,
                       quantise_on_writer=on_writer, reservation=save_reservation(2, precision, H, KB, D, dtype))
    # two requests in one step, an odd number of blocks each; engine blocks neither ordered nor contiguous
    order = torch.randperm(NB, generator=torch.Generator().manual_seed(1)).tolist()
    saves = [SaveSpec("a", "acme", False, 0, tuple(tokens(3 * KB + 5, seed=1)), tuple(order[: 3 * RATIO])),
             SaveSpec("b", "acme", False, 1, tuple(tokens(6 * KB, seed=2)), tuple(order[3 * RATIO: 8 * RATIO]))]
    try:
        assert writer.copy_out_step(saves, caches) == [None, None]
        assert writer.drain(HANG_S)
        root = IDENT.key_root(precision, KB, book.credentials("acme").salt)
        files = 0
        for spec in saves:
            blocks = block_chain(root, spec.token_ids)[spec.first:]
            old = old_snapshots(caches, lay, spec.block_ids, blocks, root=root, tenant="acme", precision=precision,
                                kv_block=KB, created_at=NOW, ttl_s=3600.0)
            for block, snap in zip(blocks, old, strict=True):
                written = writer.local.read(object_name("acme", block.key))
                assert written is not None
                if dtype != torch.float32:
                    assert bytes(written) == snapshot_bytes(snap)
                else:
                    new = read_snapshot(written)
                    assert replace(new.header, quant_error=snap.header.quant_error) == snap.header
                    assert new.payload is not None and new.payload[0].tobytes() == snap.payload.tobytes()
                    for key, errs in snap.header.quant_error.items():
                        assert new.header.quant_error[key] == pytest.approx(errs, rel=1e-6, abs=1e-12)
                files += 1
        assert files == 8 and writer.counters.totals()["written_back_blocks"] == 8
        assert writer.reservation is not None and writer.reservation.frames == (0 if on_writer else 4 * LAYERS)
    finally:
        writer.close()


def test_a_reservation_too_small_for_one_block_is_refused_when_write_back_starts(tmp_path) -> None:
    lay = layout("split", blocks=NB, heads=H, block=EB, dim=D, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="device_scratch_bytes"):
        WriteBack(Store([LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)]), TenantBook(cfg(), "acme"), (IDENT, None),
                  Precision(), kv_block=KB, ttl_s=3600.0, layout=lay, counters=Counters(),
                  reservation=Reservation(4096, "cpu"))


def test_a_step_whose_kernels_fail_is_counted_dropped_and_releases_its_room(tmp_path) -> None:
    lay = layout("cpu_vec", blocks=NB, heads=H, block=EB, dim=D, dtype=torch.bfloat16)
    c = cfg()
    writer = WriteBack(Store([LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)]), TenantBook(c, "acme"), (IDENT, None),
                       Precision(), kv_block=KB, ttl_s=3600.0, layout=lay, counters=Counters())
    save = SaveSpec("a", "acme", False, 0, tuple(tokens(2 * KB, seed=1)), tuple(range(2 * RATIO)))
    try:
        with pytest.raises((RuntimeError, ValueError)):  # a cache of another geometry than the layout's
            writer.copy_out_step([save], [torch.zeros(3, 5)])
        assert writer.queued_bytes == 0 and writer.counters.totals()["write_back_dropped:error"] == 2
    finally:
        writer.close()
