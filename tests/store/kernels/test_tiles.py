"""The native tile transpose: the same bits as numpy's transposed copy, every tile checked against its buffers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.paging import read_layer, write_layer
from store.kernels import tiles

pytestmark = pytest.mark.skipif(not tiles.native_transpose(), reason="the native module is not built")


def _reference(cache: np.ndarray, ids: np.ndarray, k: np.ndarray) -> None:
    nb, heads, width = cache.shape
    n = len(ids)
    block, dim = k.shape[1] // n, k.shape[2]
    halves = cache.reshape(nb, heads, 2, block * dim)
    halves[:, :, 0].reshape(nb, heads, dim, block)[ids] = k.reshape(heads, n, block, dim).transpose(1, 0, 3, 2)


@pytest.mark.parametrize("heads,block,dim", [(4, 128, 64), (2, 16, 8), (3, 13, 7), (1, 9, 17), (2, 8, 24), (1, 1, 1)])
def test_k_written_transposed_into_each_block_is_numpys_bits(heads: int, block: int, dim: int) -> None:
    rng = np.random.default_rng(block * dim)
    nb = 11
    ids = rng.permutation(nb)[:5].astype(np.int64)
    k = rng.integers(-(1 << 15), 1 << 15, size=(heads, 5 * block, dim), dtype=np.int16)
    start = rng.integers(-(1 << 15), 1 << 15, size=(nb, heads, 2 * block * dim), dtype=np.int16)
    got, want = start.copy(), start.copy()
    assert tiles.transpose_k_into(got, ids, k)
    _reference(want, ids, k)
    assert np.array_equal(got, want)  # V halves and the blocks not written are untouched too


def test_a_block_id_outside_the_cache_or_a_shape_that_does_not_fit_is_refused_and_nothing_is_written() -> None:
    cache = np.zeros((4, 2, 2 * 8 * 8), dtype=np.int16)
    k = np.ones((2, 16, 8), dtype=np.int16)
    with pytest.raises(ValueError, match="outside the cache"):
        tiles.transpose_k_into(cache, np.array([1, 4]), k)
    with pytest.raises(ValueError, match="does not fill"):
        tiles.transpose_k_into(cache, np.array([1, 2, 3]), k)
    with pytest.raises(ValueError, match="does not fit"):
        tiles.transpose_k_into(cache, np.array([1]), k)
    assert not cache.any()


def test_the_native_module_checks_every_tile_against_its_buffers() -> None:
    src, dst = np.zeros(64, dtype=np.int16), np.zeros(64, dtype=np.int16)
    with pytest.raises(ValueError, match="outside its buffers"):
        tiles._native.transpose_tiles(src, dst, np.array([0], np.int64), np.array([1], np.int64), 8, 8)
    with pytest.raises(ValueError, match="outside its buffers"):
        tiles._native.transpose_tiles(src, dst, np.array([-1], np.int64), np.array([0], np.int64), 2, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cpu_vec_load_reads_back_as_written_with_and_without_the_native_transpose(monkeypatch, dtype) -> None:
    H, B, D, NB = 4, 128, 64, 12
    lay = EngineLayout("cpu_vec", NB, H, B, D, dtype)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(H, 3 * B, D, generator=g).to(dtype) for _ in range(2))
    ids = (7, 2, 9)
    native = torch.full((NB, H, B, 2 * D), -3.0, dtype=dtype)
    write_layer(native, lay, ids, k, v)
    monkeypatch.setattr(tiles, "_native", None)
    plain = torch.full((NB, H, B, 2 * D), -3.0, dtype=dtype)
    write_layer(plain, lay, ids, k, v)
    assert torch.equal(native.view(torch.int16), plain.view(torch.int16))
    rk, rv = read_layer(native, lay, list(ids))
    assert torch.equal(rk.view(torch.int16), k.view(torch.int16)) and torch.equal(rv.view(torch.int16), v.view(torch.int16))


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_k_read_back_out_of_the_blocks_untransposed_is_numpys_bits(ratio: int) -> None:
    rng = np.random.default_rng(ratio)
    heads, block, dim, nb = 3, 16, 8, 12
    cache = rng.integers(-(1 << 15), 1 << 15, size=(nb, heads, 2 * block * dim), dtype=np.int16)
    ids = rng.permutation(nb)[: 2 * ratio].astype(np.int64)
    out = np.zeros((2, heads, ratio * block, dim), dtype=np.int16)
    assert tiles.transpose_k_out(cache, ids, ratio, out)
    kt = cache.reshape(nb, heads, 2, dim, block)[ids, :, 0]  # [2 * ratio, heads, dim, block]
    want = kt.reshape(2, ratio, heads, dim, block).transpose(0, 2, 1, 4, 3).reshape(2, heads, ratio * block, dim)
    assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="outside the cache"):
        tiles.transpose_k_out(cache, np.array([0, nb]), 2, np.zeros((1, heads, 2 * block, dim), np.int16))
    assert not tiles.transpose_k_out(cache, np.array([], np.int64), 2, out)  # no blocks: the caller's path
