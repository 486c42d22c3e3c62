"""Moving K and V between kvwarm's layout and the engine's paged blocks, one layer at a time.

kvwarm's layout is the one every snapshot dequantises to: per layer ``K`` and ``V``, each
``[kv_heads, tokens, head_dim]``. :func:`write_layer` puts ``n`` engine blocks' worth of tokens
into the engine blocks ``block_ids`` (token ``t`` into block ``block_ids[t // block_size]``);
:func:`read_layer` takes them back out (write-back: :func:`take_blocks` copies the
blocks out while the engine holds them, :func:`unpack_blocks` reorders them later, off the forward path). Each is a few whole-tensor operations
(views, one indexed copy or scatter): no loop over blocks. The layout comes from
:func:`store.engines.vllm.layout.detect_layout`.
"""
from __future__ import annotations

import torch

from store.engines.vllm.layout import EngineLayout


def _ids(block_ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long).to(device)


def write_layer(cache: torch.Tensor, layout: EngineLayout, block_ids: torch.Tensor | list[int],
                k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k`` and ``v`` (``[kv_heads, n * block_size, head_dim]``) into engine blocks ``block_ids``.

    Raises:
        ValueError: the token count is not ``len(block_ids)`` whole engine blocks.
    """
    H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
    ids = _ids(block_ids, cache.device)
    n = int(ids.numel())
    if tuple(k.shape) != (H, n * B, D) or tuple(v.shape) != (H, n * B, D):
        raise ValueError(f"K/V of shape {tuple(k.shape)}, {tuple(v.shape)} do not fill {n} engine blocks "
                         f"of {B} tokens, {H} heads, head dim {D}")
    k = k.to(cache.device, cache.dtype).view(H, n, B, D)
    v = v.to(cache.device, cache.dtype).view(H, n, B, D)
    if layout.kind == "cpu_vec":
        flat = cache.view(layout.num_blocks, H, 2 * B * D)
        flat[ids, :, : B * D] = k.permute(1, 0, 3, 2).reshape(n, H, D * B)  # K transposed: [D, B] per head
        flat[ids, :, B * D :] = v.permute(1, 0, 2, 3).reshape(n, H, B * D)
    elif layout.kind == "cpu_permuted":
        assert layout.index is not None
        blocks = torch.empty((n, layout.block_elements), dtype=cache.dtype, device=cache.device)
        src = torch.stack([k, v]).permute(2, 0, 1, 3, 4).reshape(n, -1)  # [n, (kv, head, token, dim)]
        blocks[:, layout.index.reshape(-1).to(cache.device)] = src
        cache.view(layout.num_blocks, -1).index_copy_(0, ids, blocks)
    elif layout.kind == "split":
        cache[ids, :, :, :D] = k.permute(1, 0, 2, 3)
        cache[ids, :, :, D:] = v.permute(1, 0, 2, 3)
    elif layout.kind == "kv_first":
        cache[0, ids] = k.permute(1, 2, 0, 3)
        cache[1, ids] = v.permute(1, 2, 0, 3)
    else:
        raise ValueError(f"unknown layout kind {layout.kind!r}")


def take_blocks(cache: torch.Tensor, layout: EngineLayout, block_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """A copy of engine blocks ``block_ids`` of one layer, still in the engine's layout (one indexed copy:
    the part of write-back that must happen before the engine reuses the blocks)."""
    ids = _ids(block_ids, cache.device)
    if layout.kind == "kv_first":
        return cache.index_select(1, ids)
    return cache.index_select(0, ids)


def unpack_blocks(blocks: torch.Tensor, layout: EngineLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each ``[kv_heads, n * block_size, head_dim]``, of blocks :func:`take_blocks` copied."""
    H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
    n = int(blocks.shape[1] if layout.kind == "kv_first" else blocks.shape[0])
    if layout.kind == "cpu_vec":
        flat = blocks.reshape(n, H, 2 * B * D)
        k = flat[:, :, : B * D].reshape(n, H, D, B).permute(1, 0, 3, 2)
        v = flat[:, :, B * D :].reshape(n, H, B, D).permute(1, 0, 2, 3)
    elif layout.kind == "cpu_permuted":
        assert layout.index is not None
        kv = blocks.reshape(n, -1)[:, layout.index.reshape(-1).to(blocks.device)].view(n, 2, H, B, D)
        k, v = kv[:, 0].permute(1, 0, 2, 3), kv[:, 1].permute(1, 0, 2, 3)
    elif layout.kind == "split":
        k, v = blocks[..., :D].permute(1, 0, 2, 3), blocks[..., D:].permute(1, 0, 2, 3)
    elif layout.kind == "kv_first":
        k, v = blocks[0].permute(2, 0, 1, 3), blocks[1].permute(2, 0, 1, 3)  # [n, B, H, D] -> [H, n, B, D]
    else:
        raise ValueError(f"unknown layout kind {layout.kind!r}")
    return k.reshape(H, n * B, D), v.reshape(H, n * B, D)


def read_layer(cache: torch.Tensor, layout: EngineLayout,
               block_ids: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of engine blocks ``block_ids``, each ``[kv_heads, n * block_size, head_dim]`` (a copy)."""
    return unpack_blocks(take_blocks(cache, layout, block_ids), layout)
