"""Engine caches of every layout kvwarm knows, filled with random KV, for the write-back and load kernels' tests.

The reference for what a cache holds is :func:`store.engines.vllm.paging.read_layer` (the path write-back
took before the batched kernels).
"""
from __future__ import annotations

import torch

from store.engines.vllm.layout import EngineLayout

KINDS = ("cpu_vec", "cpu_permuted", "split", "kv_first")


def layout(kind: str, *, blocks: int, heads: int, block: int, dim: int, dtype: torch.dtype, seed: int = 0,
           run: int = 1) -> EngineLayout:
    """A layout of ``kind``; ``cpu_permuted`` gets a random in-block order: a permutation of every element, or
    with ``run`` (dividing ``dim``) of aligned runs of ``run`` consecutive elements (as tile packings keep)."""
    index = None
    if kind == "cpu_permuted":
        g = torch.Generator().manual_seed(seed)
        starts = torch.randperm(2 * heads * block * dim // run, generator=g) * run
        index = (starts.view(-1, 1) + torch.arange(run)).view(2, heads, block, dim)
    return EngineLayout(kind, blocks, heads, block, dim, dtype, index)


def random_cache(lay: EngineLayout, *, seed: int = 0, outliers: bool = True) -> torch.Tensor:
    """A cache of ``lay`` (CUDA's strides for ``split``) holding random values, a few large (as keys have)."""
    g = torch.Generator().manual_seed(seed)
    nb, H, B, D = lay.num_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim
    if lay.kind == "kv_first":
        shape: tuple[int, ...] = (2, nb, B, H, D)
    elif lay.kind == "split":
        shape = (nb, B, H, 2 * D)
    else:
        shape = (nb, H, B, 2 * D)
    x = torch.randn(shape, generator=g)
    if outliers:
        x = x * torch.where(torch.rand(shape, generator=g) < 0.01, 40.0, 1.0)
    cache = x.to(lay.dtype)
    return cache.transpose(1, 2) if lay.kind == "split" else cache  # [nb, H, B, 2D] with NHD strides
