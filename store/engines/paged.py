"""Writing stored KV into the caches engines use: contiguous (transformers) and paged (vLLM).

Pure tensor code: no I/O; transformers only inside :func:`put_layer`. Stored blocks are
dequantised on the way by :mod:`store.kernels.dequant`.

Layouts:
- contiguous: per layer ``[kv_heads, tokens, head_dim]`` (a ``DynamicCache`` adds the batch axis);
- paged (vLLM): per layer ``[2, num_blocks, engine_block_size, kv_heads, head_dim]``, K at
  index 0 and V at 1; token ``t`` of the prefix goes to block ``block_ids[t // ebs]``,
  slot ``t % ebs``. The engine's block size need not equal the snapshot's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from store.kernels.dequant import BlockPart, dequantize_into


def check_paged(kv_caches: Sequence[torch.Tensor], num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Check vLLM-layout caches against a snapshot's geometry; returns the engine block size.

    Raises:
        ValueError: a layer count, shape or dtype the snapshots cannot fill.
    """
    if len(kv_caches) != num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} layers; the snapshots have {num_layers}")
    ebs = None
    for i, c in enumerate(kv_caches):
        if c.dim() != 5 or c.shape[0] != 2 or c.shape[3] != num_kv_heads or c.shape[4] != head_dim:
            raise ValueError(
                f"kv_caches[{i}] has shape {tuple(c.shape)}; expected [2, num_blocks, block_size, "
                f"{num_kv_heads}, {head_dim}] (vLLM's flash-attention layout)")
        if not c.dtype.is_floating_point or c.element_size() == 1:
            raise ValueError(f"kv_caches[{i}] has dtype {c.dtype}; fill bf16, fp16 or fp32 caches "
                             "(FP8 engine caches with their own scales are not supported)")
        ebs = c.shape[2] if ebs is None else ebs
        if c.shape[2] != ebs:
            raise ValueError("every layer's cache must have the same block size")
    return int(ebs or 0)


def fill_paged(cache: torch.Tensor, which: int, parts: Sequence[BlockPart], block_ids: Sequence[int],
               tokens: int, group_tokens: int = 0, dequant: Callable[..., None] = dequantize_into) -> None:
    """Write the first ``tokens`` tokens of consecutive stored blocks into one layer's paged cache.

    ``which`` is 0 for K, 1 for V. Engine blocks are ``block_ids`` in prefix order.
    """
    ebs = cache.shape[2]
    dst_all = cache[which]  # [num_blocks, ebs, heads, dim]
    t = 0
    for stored, scale in parts:
        if t >= tokens:
            break
        bs = stored.shape[1]
        n = min(bs, tokens - t)
        # Token-major for the paged layout: [tokens, heads, dim].
        tmp = torch.empty((stored.shape[0], bs, stored.shape[2]), dtype=cache.dtype, device=cache.device)
        dequant(tmp, stored, scale, group_tokens)
        src = tmp.transpose(0, 1)[:n]
        if t % ebs == 0 and n % ebs == 0:
            # Whole engine blocks: one indexed copy.
            first = t // ebs
            ids = torch.as_tensor(list(block_ids[first : first + n // ebs]), dtype=torch.long, device=cache.device)
            dst_all.index_copy_(0, ids, src.reshape(n // ebs, ebs, *src.shape[1:]))
        else:
            done = 0
            while done < n:
                pos = t + done
                slot = pos % ebs
                m = min(ebs - slot, n - done)
                dst_all[block_ids[pos // ebs], slot : slot + m].copy_(src[done : done + m])
                done += m
        t += n


#: id(config) -> (config, layers): configs whose DynamicCache holds only plain DynamicLayers
_PLAIN_CONFIGS: dict[int, tuple[Any, int]] = {}


def new_dynamic_cache(config: Any) -> Any:
    """``DynamicCache(config=config)`` (``DynamicCache()`` for ``None``), made quickly where it can be.

    DynamicCache's constructor walks the config's layer types on every call (~0.25 ms for
    12 layers). Where that walk gives only plain ``DynamicLayer`` s, as for every
    full-attention model, the result is remembered per config object and later caches are
    made with that many fresh layers directly: the same object a config-built cache is.
    Sliding-window and other hybrid configs are built by the constructor each time.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

    if config is None:
        return DynamicCache()
    known = _PLAIN_CONFIGS.get(id(config))
    if known is not None and known[0] is config:
        cache = DynamicCache.__new__(DynamicCache)
        Cache.__init__(cache, layers=[DynamicLayer() for _ in range(known[1])])
        return cache
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers) and not cache.offloading:
        if len(_PLAIN_CONFIGS) >= 16:
            _PLAIN_CONFIGS.clear()
        _PLAIN_CONFIGS[id(config)] = (config, len(cache.layers))
    return cache


def put_layer(cache: Any, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """``cache.update(k, v, layer_idx=i)`` without its copy where that is exactly equivalent.

    A plain ``DynamicLayer`` concatenates what it is given to what it holds, so a first
    update copies the whole prefix once more. Such a layer is initialised as ``update``
    would (``lazy_initialization``, or an empty update where the cache has yet to create
    it) and then handed the tensors themselves; any other kind of layer (sliding window,
    quantised...) gets the plain ``update``.
    """
    from transformers.cache_utils import DynamicLayer

    layer = cache.layers[i] if i < len(cache.layers) else None
    if type(layer) is DynamicLayer and getattr(layer, "is_initialized", True) is False:
        layer.lazy_initialization(k, v)  # what update() does first; its concatenation is skipped
        layer.keys, layer.values = k, v
        return
    cache.update(k[:, :, :0], v[:, :, :0], layer_idx=i)  # creates and initialises the layer, adds nothing
    layer = cache.layers[i]
    if type(layer) is DynamicLayer and layer.keys.numel() == 0:
        layer.keys, layer.values = k, v
    else:
        cache.update(k, v, layer_idx=i)
