"""Moving K and V between kvwarm's layout and the engine's paged blocks, one layer at a time.

kvwarm's layout is the one every snapshot dequantises to: per layer ``K`` and ``V``, each
``[kv_heads, tokens, head_dim]``. :func:`write_layer` puts ``n`` engine blocks' worth of tokens
into the engine blocks ``block_ids`` (token ``t`` into block ``block_ids[t // block_size]``);
:func:`read_layer` takes them back out (write-back: :func:`take_blocks` copies the blocks out
while the engine holds them, :func:`unpack_blocks` reorders them later, off the forward path).

Each is a few whole-array operations (one reordering copy, one indexed copy): no loop over
blocks. On the CPU they are numpy copies of the bits: torch's copies start an OpenMP team per
call, which on a busy host costs ~100x more than the copy (measured on the 2-core host:
0.35 s against 0.9 ms for the 2 MiB of a 2,048-token kvwarm-tiny load). The layout comes from
:func:`store.engines.vllm.layout.detect_layout`.
"""
from __future__ import annotations

import numpy as np
import torch

from store.engines.vllm.layout import EngineLayout
from store.kernels.dequant import bits_dtype
from store.kernels.tiles import transpose_k_into

_CPU_KINDS = ("cpu_vec", "cpu_permuted")


def _bits(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor's bits (2- or 4-byte dtypes), else ``None``."""
    if t.device.type != "cpu" or t.element_size() not in (2, 4):
        return None
    return t.view(bits_dtype(t.dtype)).numpy()


def _ids(block_ids: torch.Tensor | list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long).to(device)


def write_layer(cache: torch.Tensor, layout: EngineLayout, block_ids: torch.Tensor | list[int] | tuple[int, ...],
                k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k`` and ``v`` (``[kv_heads, n * block_size, head_dim]``) into engine blocks ``block_ids``.

    Raises:
        ValueError: the token count is not ``len(block_ids)`` whole engine blocks.
    """
    H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
    n = len(block_ids)
    if tuple(k.shape) != (H, n * B, D) or tuple(v.shape) != (H, n * B, D):
        raise ValueError(f"K/V of shape {tuple(k.shape)}, {tuple(v.shape)} do not fill {n} engine blocks "
                         f"of {B} tokens, {H} heads, head dim {D}")
    k = k.to(cache.device, cache.dtype)
    v = v.to(cache.device, cache.dtype)
    dst, kn, vn = _bits(cache), _bits(k), _bits(v)
    if layout.kind in _CPU_KINDS and dst is not None and kn is not None and vn is not None:
        ids = np.asarray(block_ids, dtype=np.int64)
        kb, vb = kn.reshape(H, n, B, D), vn.reshape(H, n, B, D)
        if layout.kind == "cpu_vec":
            # per (block, head): K transposed, [D, B] (natively where built), then V, [B, D]
            halves = dst.reshape(layout.num_blocks, H, 2, B * D)
            if not transpose_k_into(dst.reshape(layout.num_blocks, H, 2 * B * D), ids, kn):
                halves[:, :, 0].reshape(layout.num_blocks, H, D, B)[ids] = kb.transpose(1, 0, 3, 2)
            halves[:, :, 1].reshape(layout.num_blocks, H, B, D)[ids] = vb.transpose(1, 0, 2, 3)
        else:
            assert layout.index is not None
            blocks = np.empty((n, layout.block_elements), dtype=dst.dtype)
            blocks[:, layout.index.reshape(-1).numpy()] = np.stack([kb, vb]).transpose(2, 0, 1, 3, 4).reshape(n, -1)
            dst.reshape(layout.num_blocks, -1)[ids] = blocks
        return
    ids_t = _ids(block_ids, cache.device)
    k4, v4 = k.view(H, n, B, D), v.view(H, n, B, D)
    if layout.kind == "cpu_vec":
        flat_t = cache.view(layout.num_blocks, H, 2 * B * D)
        flat_t[ids_t, :, : B * D] = k4.permute(1, 0, 3, 2).reshape(n, H, D * B)
        flat_t[ids_t, :, B * D :] = v4.permute(1, 0, 2, 3).reshape(n, H, B * D)
    elif layout.kind == "cpu_permuted":
        assert layout.index is not None
        blocks_t = torch.empty((n, layout.block_elements), dtype=cache.dtype, device=cache.device)
        blocks_t[:, layout.index.reshape(-1).to(cache.device)] = torch.stack([k4, v4]).permute(2, 0, 1, 3, 4).reshape(n, -1)
        cache.view(layout.num_blocks, -1).index_copy_(0, ids_t, blocks_t)
    elif layout.kind == "split":
        cache[ids_t, :, :, :D] = k4.permute(1, 0, 2, 3)
        cache[ids_t, :, :, D:] = v4.permute(1, 0, 2, 3)
    elif layout.kind == "kv_first":
        cache[0, ids_t] = k4.permute(1, 2, 0, 3)
        cache[1, ids_t] = v4.permute(1, 2, 0, 3)
    else:
        raise ValueError(f"unknown layout kind {layout.kind!r}")


def block_runs(block_ids: list[int] | tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``block_ids`` as maximal runs of consecutive ids: ``(position, first id, length)`` each."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(int(x) for x in block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            p, first, n = runs[-1]
            runs[-1] = (p, first, n + 1)
        else:
            runs.append((pos, b, 1))
    return runs


def take_blocks(cache: torch.Tensor, layout: EngineLayout, block_ids: torch.Tensor | list[int] | tuple[int, ...], *,
                host: bool = False) -> torch.Tensor:
    """A copy of engine blocks ``block_ids`` of one layer, still in the engine's layout (one indexed copy:
    the part of write-back that must happen before the engine reuses the blocks).

    With ``host`` and a cache on a device: into host memory (pinned where CUDA is), one
    non-blocking copy per run of consecutive ids; it is complete once an event recorded on
    the current stream after it has happened. No device memory is taken.
    """
    src = _bits(cache)
    if layout.kind in _CPU_KINDS and src is not None:
        ids = np.asarray(block_ids, dtype=np.int64)
        return torch.from_numpy(src.reshape(layout.num_blocks, -1)[ids]).view(cache.dtype).view(
            len(ids), *cache.shape[1:])
    if host:
        axis = 1 if layout.kind == "kv_first" else 0
        ids_list = [int(b) for b in block_ids]
        shape = list(cache.shape)
        shape[axis] = len(ids_list)
        out = torch.empty(shape, dtype=cache.dtype, pin_memory=cache.device.type == "cuda")
        for pos, first, n in block_runs(ids_list):
            out.narrow(axis, pos, n).copy_(cache.narrow(axis, first, n), non_blocking=cache.device.type == "cuda")
        return out
    ids_t = _ids(block_ids, cache.device)
    if layout.kind == "kv_first":
        return cache.index_select(1, ids_t)
    return cache.index_select(0, ids_t)


def unpack_blocks(blocks: torch.Tensor, layout: EngineLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each ``[kv_heads, n * block_size, head_dim]``, of blocks :func:`take_blocks` copied."""
    H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
    n = int(blocks.shape[1] if layout.kind == "kv_first" else blocks.shape[0])
    raw = _bits(blocks)
    if layout.kind in _CPU_KINDS and raw is not None:
        if layout.kind == "cpu_vec":
            flat = raw.reshape(n, H, 2 * B * D)
            kn = flat[:, :, : B * D].reshape(n, H, D, B).transpose(1, 0, 3, 2)
            vn = flat[:, :, B * D :].reshape(n, H, B, D).transpose(1, 0, 2, 3)
        else:
            assert layout.index is not None
            kv = raw.reshape(n, -1)[:, layout.index.reshape(-1).numpy()].reshape(n, 2, H, B, D)
            kn, vn = kv[:, 0].transpose(1, 0, 2, 3), kv[:, 1].transpose(1, 0, 2, 3)
        k = torch.from_numpy(np.ascontiguousarray(kn).reshape(H, n * B, D)).view(blocks.dtype)
        v = torch.from_numpy(np.ascontiguousarray(vn).reshape(H, n * B, D)).view(blocks.dtype)
        return k, v
    if layout.kind == "cpu_vec":
        flat_t = blocks.reshape(n, H, 2 * B * D)
        k4 = flat_t[:, :, : B * D].reshape(n, H, D, B).permute(1, 0, 3, 2)
        v4 = flat_t[:, :, B * D :].reshape(n, H, B, D).permute(1, 0, 2, 3)
    elif layout.kind == "cpu_permuted":
        assert layout.index is not None
        kv_t = blocks.reshape(n, -1)[:, layout.index.reshape(-1).to(blocks.device)].view(n, 2, H, B, D)
        k4, v4 = kv_t[:, 0].permute(1, 0, 2, 3), kv_t[:, 1].permute(1, 0, 2, 3)
    elif layout.kind == "split":
        k4, v4 = blocks[..., :D].permute(1, 0, 2, 3), blocks[..., D:].permute(1, 0, 2, 3)
    elif layout.kind == "kv_first":
        k4, v4 = blocks[0].permute(2, 0, 1, 3), blocks[1].permute(2, 0, 1, 3)  # [n, B, H, D] -> [H, n, B, D]
    else:
        raise ValueError(f"unknown layout kind {layout.kind!r}")
    return k4.reshape(H, n * B, D), v4.reshape(H, n * B, D)


def read_layer(cache: torch.Tensor, layout: EngineLayout,
               block_ids: torch.Tensor | list[int] | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of engine blocks ``block_ids``, each ``[kv_heads, n * block_size, head_dim]`` (a copy)."""
    return unpack_blocks(take_blocks(cache, layout, block_ids), layout)
