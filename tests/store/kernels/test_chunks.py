"""The kernels chunk by chunk in one reservation give the whole-batch kernels' bits (and so the codec's:
test_scatter.py, test_gather.py), with chunk boundaries inside a request and inside a kvwarm block's
engine blocks, over every engine layout."""
from __future__ import annotations

import pytest
import torch

from store.errors import ConfigError
from store.format.precision import Precision
from store.kernels.chunks import chunk_blocks, load_block_bytes, quantise_to_host, scatter_stored
from store.kernels.gather import block_ids, gather_quantise
from store.kernels.reservation import Reservation
from store.kernels.scatter import dequantise_scatter
from store.kernels.staging import Staging
from tests.store.kernels.chunking import load_reservation, save_reservation, stacked, stored_parts
from tests.store.kernels.engine_caches import KINDS, layout, random_cache

H, B, D, NB = 2, 8, 8, 24
PRECISIONS = {
    "fp8-head": Precision(),
    "fp8-group8": Precision(granularity="head_group", group_tokens=8),
    "fp8-group12": Precision(granularity="head_group", group_tokens=12),  # the last group is short
    "fp8-keep": Precision(keep_layers=(1,), keep_dtype="fp16"),
    "bf16": Precision(compression="bf16"),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["fp8-head", "fp8-group8", "fp8-group12", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_load_chunk_by_chunk_writes_the_whole_kernels_bits(kind: str, name: str, dtype: torch.dtype) -> None:
    precision, ratio, n = PRECISIONS[name], 3, 5
    g = precision.group_tokens
    lay = layout(kind, blocks=NB, heads=H, block=B, dim=D, dtype=dtype, seed=3)
    runs = stored_parts(n, H, ratio * B, D, precision, seed=len(name))
    (k, ks), (v, vs) = stacked(runs[0]), stacked(runs[1])
    cache = random_cache(lay, seed=5)
    # chunks of two kvwarm blocks (six engine blocks): boundaries inside each request
    for skip, ids in ((0, [9, 2, 11, 0, 5, 7, 13, 1, 4, 20, 22, 17, 15]), (2, [6, 3, 12, 8, 19, 21, 23]),
                      (4, [10, 14, 16]), (7, [18])):
        want = cache.clone()
        dequantise_scatter(want, lay, block_ids(ids, "cpu"), k=k, k_scale=ks, v=v, v_scale=vs, skip=skip,
                           group_tokens=g)
        got = cache.clone()
        res = load_reservation(2, H, ratio * B, D, k.dtype, dtype, g)
        assert scatter_stored(got, lay, block_ids(ids, "cpu"), runs, skip=skip, staging=Staging(1 << 12),
                              reservation=res, group_tokens=g)
        assert torch.equal(bits(got), bits(want))
        # chunks of two kvwarm blocks from the first one the load touches
        chunks = {((skip + i) // ratio - skip // ratio) // 2 for i in range(len(ids))}
        assert res.peak <= res.size and res.frames == len(chunks)


def test_parts_of_mixed_kinds_are_left_to_the_caller() -> None:
    lay = layout("split", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16)
    fp8 = stored_parts(2, H, 2 * B, D, PRECISIONS["fp8-head"], seed=1)
    bf16 = stored_parts(2, H, 2 * B, D, PRECISIONS["bf16"], seed=1)
    cache = random_cache(lay, seed=1)
    got = cache.clone()
    res = Reservation(1 << 20, "cpu")
    assert not scatter_stored(got, lay, block_ids([1, 2, 3, 4], "cpu"), [fp8[0], bf16[1]], skip=0,
                              staging=Staging(1 << 12), reservation=res)
    assert torch.equal(got, cache)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(PRECISIONS))
def test_a_save_chunk_by_chunk_is_the_whole_kernels_bits(kind: str, name: str) -> None:
    precision, ratio = PRECISIONS[name], 3
    lay = layout(kind, blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16, seed=4)
    cache = random_cache(lay, seed=6)
    ids = block_ids([9, 2, 11, 0, 5, 7, 13, 1, 4, 20, 22, 17, 15, 3, 6], "cpu")  # five kvwarm blocks
    for layer in (0, 1):
        want = gather_quantise(cache, lay, ids, ratio=ratio, precision=precision, layer=layer)
        res = save_reservation(2, precision, H, ratio * B, D, torch.bfloat16)  # chunks of 2, 2, 1 blocks
        got = quantise_to_host(cache, lay, ids, ratio=ratio, precision=precision, layer=layer, reservation=res)
        for a, b in ((got.k, want.k), (got.k_scale, want.k_scale), (got.v, want.v), (got.v_scale, want.v_scale),
                     (got.errors, want.errors)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))
        assert res.peak <= res.size and res.frames == 3


def test_a_reservation_smaller_than_one_blocks_work_says_which_setting_to_raise() -> None:
    res = Reservation(1 << 20, "cpu")
    with pytest.raises(ConfigError, match="device_scratch_bytes"):
        chunk_blocks(res, load_block_bytes(8, 256, 128, torch.float8_e4m3fn, torch.bfloat16), "load")
    assert chunk_blocks(res, 1000, "load") == (res.usable - 40 * 256) // 1000
