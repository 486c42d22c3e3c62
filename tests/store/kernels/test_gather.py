"""Write-back's batched kernel agrees bit for bit with the codec, block by block, over every engine layout.

The reference is what write-back did before it: :func:`store.engines.vllm.paging.read_layer` of each
kvwarm block's engine blocks, then :func:`store.format.precision.quantize`, ``dequantize`` and
``relative_error`` of that block alone, as :func:`store.format.encode.build_snapshot` calls them, on the
block in kvwarm's contiguous ``[kv_heads, tokens, head_dim]`` order. (``read_layer`` of the ``kv_first``
layout returns a token-major view; ``relative_error`` of such a view sums ``||x||`` in memory order, which
can differ from the contiguous block's in the last bit: the kernel's errors are the contiguous block's.)
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from store.engines.vllm.paging import read_layer
from store.format.precision import Precision, dequantize, quantize, relative_error
from store.kernels.gather import block_ids, gather_kv, gather_quantise, quantise_blocks, stored_block_bytes
from tests.store.kernels.engine_caches import KINDS, layout, random_cache

H, B, D, NB = 2, 16, 8, 14
PRECISIONS = {
    "fp8-head": Precision(),
    "fp8-group8": Precision(granularity="head_group", group_tokens=8),
    "fp8-group12": Precision(granularity="head_group", group_tokens=12),  # the last group is short
    "fp8-keep": Precision(keep_layers=(1,), keep_dtype="fp16"),
    "bf16": Precision(compression="bf16"),
    "fp16": Precision(compression="fp16"),
    "fp32": Precision(compression="fp32"),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_codec(got, x: torch.Tensor, precision: Precision, layer: int) -> None:
    """``got`` (stored, scale, errors of one block) is what the codec makes of block ``x`` alone."""
    stored, scale, err = got
    q, s = quantize(x, precision, layer)
    assert stored.dtype == q.dtype and torch.equal(bits(stored), bits(q))
    assert (scale is None) == (s is None)
    if s is not None:
        assert torch.equal(bits(scale), bits(s))
    assert err == relative_error(x, dequantize(q, s, torch.float32, precision.group_tokens))


@pytest.mark.parametrize("name", list(PRECISIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 3])
def test_quantise_blocks_is_the_codec_of_each_block_alone(name: str, dtype: torch.dtype, n: int) -> None:
    precision = PRECISIONS[name]
    g = torch.Generator().manual_seed(n)
    x = (torch.randn((n, H, 2 * B, D), generator=g) * torch.logspace(-3, 3, n).view(n, 1, 1, 1)).to(dtype)
    x[-1, 0] = 0  # a head of zeros: scale 1
    for layer in (0, 1):
        stored, scale, num, den = quantise_blocks(x, precision, layer)
        for j in range(n):
            err = float(num[j]) / float(den[j]) if float(den[j]) > 0 else float(num[j])
            assert_codec((stored[j], None if scale is None else scale[j], err), x[j], precision, layer)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_gather_kv_is_read_layer_in_kvwarm_blocks(kind: str, ratio: int) -> None:
    lay = layout(kind, blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16, seed=ratio)
    cache = random_cache(lay, seed=ratio)
    ids = [11, 2, 7, 0, 13, 5, 9, 4, 12][: 3 * ratio]  # neither ordered nor contiguous
    k, v = gather_kv(cache, lay, block_ids(ids, "cpu"), ratio)
    assert k.is_contiguous() and v.is_contiguous() and tuple(k.shape) == (3, H, ratio * B, D)
    for j in range(3):
        rk, rv = read_layer(cache, lay, ids[j * ratio:(j + 1) * ratio])
        assert torch.equal(bits(k[j]), bits(rk)) and torch.equal(bits(v[j]), bits(rv))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["fp8-head", "fp8-group12", "fp8-keep", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_quantise_stores_each_block_as_write_back_did(kind: str, name: str, dtype: torch.dtype) -> None:
    precision, ratio = PRECISIONS[name], 2
    lay = layout(kind, blocks=NB, heads=H, block=B, dim=D, dtype=dtype)
    cache = random_cache(lay, seed=5)
    ids = [3, 8, 1, 12, 6, 10, 0, 13, 2, 9]  # five kvwarm blocks
    for layer in (0, 1):
        got = gather_quantise(cache, lay, block_ids(ids, "cpu"), ratio=ratio, precision=precision, layer=layer)
        assert got.errors.dtype == torch.float64 and tuple(got.errors.shape) == (2, 5)
        assert got.nbytes == 5 * (stored_block_bytes(precision, layer + 1, H, ratio * B, D)
                                  - stored_block_bytes(precision, layer, H, ratio * B, D))
        for j in range(5):
            k, v = (t.contiguous() for t in read_layer(cache, lay, ids[j * ratio:(j + 1) * ratio]))
            part = got.block(j)
            assert_codec((part.k, part.k_scale, float(got.errors[0, j])), k, precision, layer)
            assert_codec((part.v, part.v_scale, float(got.errors[1, j])), v, precision, layer)


def test_no_blocks_give_empty_parts_and_a_partial_kvwarm_block_is_refused() -> None:
    lay = layout("cpu_vec", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16)
    cache = random_cache(lay)
    got = gather_quantise(cache, lay, block_ids([], "cpu"), ratio=2, precision=Precision(), layer=0)
    assert tuple(got.k.shape) == (0, H, 2 * B, D) and tuple(got.errors.shape) == (2, 0)
    with pytest.raises(ValueError, match="not whole kvwarm blocks"):
        gather_kv(cache, lay, block_ids([1, 2, 3], "cpu"), 2)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), heads=st.integers(1, 3), block=st.sampled_from([1, 4, 8]),
       dim=st.sampled_from([1, 4, 16]), ratio=st.integers(1, 3), n=st.integers(1, 4),
       group=st.sampled_from([0, 1, 3, 8]), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**16))
def test_any_small_geometry_agrees_with_the_codec(kind, heads, block, dim, ratio, n, group, dtype, seed) -> None:
    precision = Precision(granularity="head_group", group_tokens=group) if group else Precision()
    nb = n * ratio + 2
    lay = layout(kind, blocks=nb, heads=heads, block=block, dim=dim, dtype=dtype, seed=seed)
    cache = random_cache(lay, seed=seed)
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[: n * ratio].tolist()
    got = gather_quantise(cache, lay, block_ids(ids, "cpu"), ratio=ratio, precision=precision, layer=0)
    for j in range(n):
        k, v = (t.contiguous() for t in read_layer(cache, lay, ids[j * ratio:(j + 1) * ratio]))
        part = got.block(j)
        assert_codec((part.k, part.k_scale, float(got.errors[0, j])), k, precision, 0)
        assert_codec((part.v, part.v_scale, float(got.errors[1, j])), v, precision, 0)


@pytest.mark.parametrize("name", ["fp8-head", "fp8-group12"])
def test_odd_values_are_stored_as_the_codec_stores_them(name: str) -> None:
    precision = PRECISIONS[name]
    x = torch.randn((5, H, 2 * B, D))
    x[0, 0, 3, 1] = float("nan")
    x[1, 1, 0, 0] = float("inf")
    x[2, 0, 5, 2] = -float("inf")
    x[3] = -0.0  # only negative zeros: no scale
    x[4, 0] = 1e-44  # subnormal amax: the scale underflows
    stored, scale, num, den = quantise_blocks(x, precision, 0)
    for j in range(5):
        q, s = quantize(x[j], precision, 0)
        assert torch.equal(bits(stored[j]), bits(q)) and torch.equal(bits(scale[j]), bits(s))
        want = relative_error(x[j], dequantize(q, s, torch.float32, precision.group_tokens))
        got = float(num[j]) / float(den[j]) if float(den[j]) > 0 else float(num[j])
        assert got == want or (math.isnan(got) and math.isnan(want))  # NaN where the codec records NaN


@pytest.mark.parametrize("run", [1, 2, 8])
@pytest.mark.parametrize("vec_order", [False, True])
def test_a_permuted_layout_moves_its_runs_of_elements_together_and_gives_the_same_blocks(run, vec_order) -> None:
    from store.engines.vllm.layout import EngineLayout, vec_index

    lay = layout("cpu_permuted", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16, seed=run, run=run)
    if vec_order:  # the vec order as a permutation: K transposed (runs of 1), V by whole rows of D
        lay = EngineLayout("cpu_permuted", NB, H, B, D, torch.bfloat16, vec_index(H, B, D))
    assert lay.index_runs == ((1, D) if vec_order else (run, run))
    cache = random_cache(lay, seed=run)
    ids = [4, 11, 0, 7]
    k, v = gather_kv(cache, lay, block_ids(ids, "cpu"), 2)
    for j in range(2):
        rk, rv = read_layer(cache, lay, ids[2 * j:2 * j + 2])
        assert torch.equal(bits(k[j]), bits(rk)) and torch.equal(bits(v[j]), bits(rv))
