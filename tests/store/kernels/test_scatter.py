"""The load's batched kernel writes the bits that dequantise-then-write_layer wrote, over every engine layout.

The reference is the path a load takes today: :func:`store.format.precision.dequantize` of each block,
concatenated, then :func:`store.engines.vllm.paging.write_layer` of the engine blocks' tokens.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from store.engines.vllm.paging import write_layer
from store.format.precision import Precision, dequantize, quantize
from store.kernels.gather import block_ids
from store.kernels.scatter import dequantise_blocks, dequantise_scatter
from tests.store.kernels.engine_caches import KINDS, layout, random_cache

H, B, D, NB = 2, 16, 8, 14
PRECISIONS = {
    "fp8-head": Precision(),
    "fp8-group8": Precision(granularity="head_group", group_tokens=8),
    "fp8-group12": Precision(granularity="head_group", group_tokens=12),
    "bf16": Precision(compression="bf16"),
    "fp16": Precision(compression="fp16"),
}


def stored(n: int, tokens: int, precision: Precision, seed: int, heads: int = H, dim: int = D):
    """``n`` blocks of random KV as the codec stores them: K, K's scales, V, V's scales (stacked)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in ("k", "v"):
        x = torch.randn((n, heads, tokens, dim), generator=g) * torch.where(
            torch.rand((n, heads, tokens, dim), generator=g) < 0.02, 30.0, 1.0)
        parts = [quantize(x[j], precision, 0) for j in range(n)]
        out += [torch.stack([q for q, _ in parts]),
                None if parts[0][1] is None else torch.stack([s for _, s in parts])]
    return out


def reference(cache, lay, ids, parts, precision, skip) -> torch.Tensor:
    """The cache after today's load: each block dequantised alone, then write_layer of the engine blocks."""
    k, ks, v, vs = parts
    n = k.shape[0]
    deq = [torch.cat([dequantize(x[j], None if s is None else s[j], lay.dtype, precision.group_tokens)
                      for j in range(n)], dim=1) for x, s in ((k, ks), (v, vs))]
    lo, hi = skip * lay.block_size, (skip + len(ids)) * lay.block_size
    out = cache.clone()
    write_layer(out, lay, ids, deq[0][:, lo:hi], deq[1][:, lo:hi])
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(PRECISIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantise_scatter_writes_what_dequantize_and_write_layer_wrote(kind, name, dtype) -> None:
    precision, ratio = PRECISIONS[name], 3
    lay = layout(kind, blocks=NB, heads=H, block=B, dim=D, dtype=dtype, seed=2)
    cache = random_cache(lay, seed=4)
    parts = stored(3, ratio * B, precision, seed=len(name))
    for skip, ids in ((0, [9, 2, 11, 0, 5, 7, 13, 1, 4]), (2, [6, 3, 12, 8]), (4, [10])):
        want = reference(cache, lay, ids, parts, precision, skip)
        got = cache.clone()
        k, ks, v, vs = parts
        dequantise_scatter(got, lay, block_ids(ids, "cpu"), k=k, k_scale=ks, v=v, v_scale=vs, skip=skip,
                           group_tokens=precision.group_tokens)
        assert same_bits(got, want)


def test_dequantise_blocks_is_dequantize_of_each_block_and_refuses_groups_without_a_size() -> None:
    precision = Precision(granularity="head_group", group_tokens=5)
    k, ks, _, _ = stored(4, 12, precision, seed=9)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(k.shape, dtype=dtype)
        dequantise_blocks(k, ks, out, precision.group_tokens)
        for j in range(4):
            assert same_bits(out[j], dequantize(k[j], ks[j], dtype, precision.group_tokens))
    with pytest.raises(ValueError, match="group_tokens"):
        dequantise_blocks(k, ks, torch.empty(k.shape))


def test_engine_blocks_the_stored_blocks_do_not_hold_are_refused() -> None:
    lay = layout("cpu_vec", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16)
    k, ks, v, vs = stored(2, 2 * B, Precision(), seed=1)
    with pytest.raises(ValueError, match="do not hold engine blocks"):
        dequantise_scatter(random_cache(lay), lay, block_ids([1, 2, 3, 4], "cpu"), k=k, k_scale=ks, v=v,
                           v_scale=vs, skip=1)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), heads=st.integers(1, 3), block=st.sampled_from([1, 4, 8]),
       dim=st.sampled_from([1, 4, 16]), ratio=st.integers(1, 3), n=st.integers(1, 3),
       group=st.sampled_from([0, 1, 3, 8]), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       data=st.data())
def test_any_small_geometry_loads_as_today(kind, heads, block, dim, ratio, n, group, dtype, data) -> None:
    precision = Precision(granularity="head_group", group_tokens=group) if group else Precision()
    nb = n * ratio + 2
    seed = data.draw(st.integers(0, 2**16))
    lay = layout(kind, blocks=nb, heads=heads, block=block, dim=dim, dtype=dtype, seed=seed)
    cache = random_cache(lay, seed=seed)
    skip = data.draw(st.integers(0, n * ratio - 1))
    m = data.draw(st.integers(1, n * ratio - skip))
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[:m].tolist()
    parts = stored(n, ratio * block, precision, seed, heads=heads, dim=dim)
    want = reference(cache, lay, ids, parts, precision, skip)
    k, ks, v, vs = parts
    dequantise_scatter(cache, lay, block_ids(ids, "cpu"), k=k, k_scale=ks, v=v, v_scale=vs, skip=skip,
                       group_tokens=precision.group_tokens)
    assert same_bits(cache, want)


@pytest.mark.parametrize("run", [2, 8])
def test_a_permuted_layout_with_runs_is_written_as_today(run) -> None:
    precision = Precision()
    lay = layout("cpu_permuted", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16, seed=run, run=run)
    cache = random_cache(lay, seed=run)
    parts = stored(2, 2 * B, precision, seed=run)
    ids = [5, 12, 3]
    want = reference(cache, lay, ids, parts, precision, 1)
    k, ks, v, vs = parts
    dequantise_scatter(cache, lay, block_ids(ids, "cpu"), k=k, k_scale=ks, v=v, v_scale=vs, skip=1)
    assert same_bits(cache, want)
