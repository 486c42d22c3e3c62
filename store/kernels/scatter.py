"""The load's device kernel: one layer's stored blocks dequantised straight into the engine's blocks.

For one layer, ``n`` kvwarm blocks as stored (``[n, kv_heads, kv_block, head_dim]`` FP8 with fp32
scales, or unquantised) and the engine blocks to fill, :func:`dequantise_scatter` writes, with a few
whole-tensor operations where the cache lives (CPU or CUDA; no host synchronisation, no loop over
blocks), the bits that :func:`store.format.precision.dequantize` of each block followed by
:func:`store.engines.vllm.paging.write_layer` writes: ``fp32(stored) * scale`` rounded once to the
cache's dtype (the FP8 values through a 256-entry table of their fp32 bits), laid out in engine-block
order as it is computed, then one indexed write per K and V into the cache's layout.

Its temporaries come from a ``scratch`` where one is given (a :class:`store.kernels.reservation.Frame`:
:func:`store.kernels.chunks.scatter_stored` drives it chunk by chunk), else from torch's allocator.

The write may start past the first kvwarm block's first engine block (``skip``: tokens the engine
already holds) and covers ``len(ids)`` engine blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from store.kernels.gather import block_views
from store.kernels.reservation import Frame, Loose

if TYPE_CHECKING:
    from store.engines.vllm.layout import EngineLayout


def dequantise_blocks(stored: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor,
                      group_tokens: int = 0, scratch: Frame | Loose | None = None) -> None:
    """``dequantize(stored[j], scale[j])`` of every block ``j`` into ``out``, rounded once to ``out``'s dtype.

    ``stored`` is ``[n, kv_heads, tokens, head_dim]``; ``out`` the same, or ``[n, kv_heads, r, tokens / r,
    head_dim]`` (the tokens in ``r`` pieces: engine blocks), any strides, any float dtype. Its temporaries
    come from ``scratch`` (a :class:`store.kernels.reservation.Frame`; by default torch's allocator).

    Raises:
        ValueError: per-group scales without ``group_tokens``.
    """
    n, heads, tokens, _ = stored.shape
    if scale is None:
        out.copy_(stored.reshape(out.shape))  # Tensor.to's conversion, as dequantize makes it
        return
    mem = scratch if scratch is not None else Loose(stored.device)
    codes = mem.take((stored.numel(),), torch.int32).copy_(stored.view(torch.uint8).reshape(-1))
    values = torch.index_select(mem.fp8_values, 0, codes, out=mem.take((stored.numel(),), torch.float32))
    if scale.dim() == 2:
        wide = scale.view(n, heads, *[1] * (out.dim() - 2))
    elif group_tokens < 1:
        raise ValueError("per-group scales need group_tokens >= 1")
    else:  # each group's scale over its tokens (repeat_interleave's values), then the first ``tokens``
        groups = scale.shape[-1]
        wide = mem.take((n, heads, groups, group_tokens), torch.float32)
        wide.copy_(scale[..., None].expand(n, heads, groups, group_tokens))
        wide = wide.view(n, heads, groups * group_tokens)[..., :tokens].reshape(*out.shape[:-1], 1)
    values = values.view(out.shape)
    if out.dtype == torch.float32:
        torch.mul(values, wide, out=out)
    else:
        out.copy_(values.mul_(wide))  # the fp32 product, rounded once


def dequantise_scatter(cache: torch.Tensor, layout: EngineLayout, ids: torch.Tensor, *, k: torch.Tensor,
                       k_scale: torch.Tensor | None, v: torch.Tensor, v_scale: torch.Tensor | None,
                       skip: int = 0, group_tokens: int = 0, scratch: Frame | Loose | None = None) -> None:
    """Write stored blocks ``k``/``v`` (``[n, kv_heads, kv_block, head_dim]``, with their scales) into
    engine blocks ``ids`` of one layer's cache: engine block ``skip + i`` of the stored tokens (in
    ``block_size`` pieces) into ``ids[i]``. The temporaries (K's, then the same bytes for V's) come from
    ``scratch`` (a :class:`store.kernels.reservation.Frame`; by default torch's allocator).

    Raises:
        ValueError: the stored blocks do not hold ``skip + len(ids)`` engine blocks of the layout's
            geometry, or the layout is unknown.
    """
    H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
    n, heads, tokens, dim = k.shape
    m = ids.shape[0]
    if (heads, dim) != (H, D) or tokens % B or skip < 0 or skip + m > n * (tokens // B) or v.shape != k.shape:
        raise ValueError(f"stored blocks {tuple(k.shape)} do not hold engine blocks {skip}..{skip + m} of "
                         f"{B} tokens, {H} heads, head dim {D}")
    ratio = tokens // B
    mem = scratch if scratch is not None else Loose(cache.device)
    for x, scale, half in ((k, k_scale, 0), (v, v_scale, 1)):
        mark = mem.mark()  # V's temporaries reuse K's bytes (after K's kernels, on the stream's order)
        # dequantised straight into engine-block order, [n * ratio, H, B, D], seen as [n, H, ratio, B, D]
        blocks = mem.take((n * ratio, H, B, D), cache.dtype)
        dequantise_blocks(x, scale, blocks.view(n, ratio, H, B, D).transpose(1, 2), group_tokens, mem)
        part = blocks[skip:skip + m]
        if layout.kind == "cpu_permuted":  # runs of consecutive elements move together
            assert layout.index is not None
            run = layout.index_runs[half]
            starts = (layout.index[half, ..., ::run].to(cache.device) // run).unsqueeze(0)  # [1, H, B, D / run]
            cache.view(layout.num_blocks, layout.block_elements // run, run).index_put_(
                (ids.view(m, 1, 1, 1), starts), part.view(m, H, B, D // run, run))
        else:
            block_views(cache, layout)[half].index_put_((ids,), part)
        mem.release(mark)
