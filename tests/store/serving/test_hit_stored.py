"""A hit's stored bytes moved as they are, then the load's kernel: the bits of ``dequantized`` then ``write_layer``
(whole, and chunk by chunk through the device's reservation).

What a device-bound load does per layer (:meth:`store.engines.vllm.worker.WorkerRole._write_layer` on a
GPU: :meth:`store.serving.hit.LoaderHit.scatter`, :meth:`store.serving.hit.LoaderHit.stored` then
:func:`store.kernels.scatter.dequantise_scatter` in chunks), run here with the CPU as the device, against
the path it replaced.
"""
from __future__ import annotations

import pytest
import torch

from store.engines.vllm.paging import write_layer
from store.kernels.dequant import Dequantizer
from store.kernels.gather import block_ids
from store.kernels.scatter import dequantise_scatter
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.store.kernels.chunking import load_reservation
from tests.store.kernels.engine_caches import KINDS, layout, random_cache
from tests.store.pool_workers import ACME, TINY, config, prompt, tiny_model, write_prefix

BS, EB = 16, 8  # kvwarm and engine blocks: two engine blocks a kvwarm block


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.bfloat16)[0]


@pytest.mark.parametrize("compression", ["fp8", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_layers_stored_bytes_scattered_are_what_dequantized_and_write_layer_wrote(tmp_path, model, compression,
                                                                                     kind) -> None:
    cfg = config(BS, compression)
    ids = prompt(4 * BS + 2, seed=3)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    write_prefix(store, cfg, model, ids[: 4 * BS])
    store.close()
    loader = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, pool_bytes=1 << 30, config=cfg,
                      pool_dir=tmp_path / "pool")
    hit = loader.lookup(ids)
    try:
        assert hit is not None
        for heads in (None, slice(1, 2)):  # every head, and a tensor-parallel rank's
            h = 2 if heads is None else 1
            lay = layout(kind, blocks=12, heads=h, block=EB, dim=16, dtype=torch.bfloat16, seed=1)
            engine = [7, 2, 10, 4, 0]  # tokens 8 .. 48: from the second engine block of kvwarm block 1
            staged = hit.stored(first_block=1, blocks=3, device="cpu", layer=1, heads=heads)
            assert staged is not None
            (sk, sv), scales = staged
            assert tuple(sk.shape) == (3, h, BS, 16) and (scales is None) == (compression != "fp8")
            got = random_cache(lay, seed=2)
            want = got.clone()
            dequantise_scatter(got, lay, block_ids(engine, "cpu"), k=sk, k_scale=None if scales is None else scales[0],
                               v=sv, v_scale=None if scales is None else scales[1], skip=1)
            k, v = hit.dequantized(torch.bfloat16, first_block=1, tokens=3 * BS, layers=[1], heads=heads)
            write_layer(want, lay, engine, k[:, EB:EB + 5 * EB], v[:, EB:EB + 5 * EB])
            assert torch.equal(got.contiguous().view(torch.int16), want.contiguous().view(torch.int16))
        with pytest.raises(ValueError, match="outside this hit"):
            hit.stored(first_block=2, blocks=3, device="cpu", layer=0)
    finally:
        hit.release()
        loader.close()


@pytest.mark.parametrize("compression", ["fp8", "fp8-group6", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_scattered_chunk_by_chunk_through_the_reservation_is_what_dequantized_and_write_layer_wrote(
        tmp_path, model, compression, kind) -> None:
    """What a vLLM worker's device load runs per layer (:meth:`LoaderHit.scatter`), with a reservation that
    holds two kvwarm blocks: the load's three blocks in two chunks, the boundary inside the request (FP8
    with per-head scales, per group of 6 tokens, or bf16)."""
    group = 6 if compression == "fp8-group6" else 0
    cfg = config(BS, compression.removesuffix("-group6"))
    if group:
        cfg = cfg.model_copy(update={"kv_cache": cfg.kv_cache.model_copy(
            update={"scale_granularity": "head_group", "group_tokens": group})})
    ids = prompt(4 * BS + 2, seed=3)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    write_prefix(store, cfg, model, ids[: 4 * BS])
    store.close()
    stored = torch.bfloat16 if compression == "bf16" else torch.float8_e4m3fn
    size = load_reservation(2, 2, BS, 16, stored, torch.bfloat16, group).size
    loader = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, pool_bytes=1 << 30, config=cfg,
                      pool_dir=tmp_path / "pool", dequant=Dequantizer(scratch_bytes=size, staging_bytes=1024))
    hit = loader.lookup(ids)
    try:
        assert hit is not None and hit.snapshots[0].header.precision.group_tokens == group
        lay = layout(kind, blocks=12, heads=2, block=EB, dim=16, dtype=torch.bfloat16, seed=1)
        engine = [7, 2, 10, 4, 0]  # tokens 8 .. 48: from the second engine block of kvwarm block 1
        got = random_cache(lay, seed=2)
        want = got.clone()
        assert hit.scatter(got, lay, block_ids(engine, "cpu"), first_block=1, blocks=3, layer=1, skip=1)
        k, v = hit.dequantized(torch.bfloat16, first_block=1, tokens=3 * BS, layers=[1])
        write_layer(want, lay, engine, k[:, EB:EB + 5 * EB], v[:, EB:EB + 5 * EB])
        assert torch.equal(got.contiguous().view(torch.int16), want.contiguous().view(torch.int16))
        res = loader.dequantizer.reservation("cpu")
        assert res.frames == 2 and res.peak <= res.size and loader.dequantizer.staging.peak_bytes <= 1024
    finally:
        hit.release()
        loader.close()
