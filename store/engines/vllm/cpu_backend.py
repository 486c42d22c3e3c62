"""vLLM's CPU backend, asked through its own cache kernel: the in-block order of an ISA, and a writer.

The CPU attention backend keeps each layer's KV as ``[num_blocks, kv_heads, block_size, 2 *
head_dim]`` in an order that depends on the ISA (``vec``, ``vec16``, ``amx``...). Rather than
know every order, kvwarm asks the kernel vLLM writes with (``cpu_attn_reshape_and_cache``):
:func:`cpu_block_order` writes probe values through it and reads the order back (write-back
reorders blocks by it), and :func:`cpu_block_writer` writes loads with it where the order is not the known
``vec`` one (which kvwarm writes itself, straight from the snapshots). Imports vLLM (inside
the functions): used by :mod:`store.engines.vllm.connector` only.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from store.engines.vllm.layout import VEC_ISAS, UnsupportedLayout, index_from_probe, probe_inputs, vec_index

log = logging.getLogger("kvwarm.vllm")


def probe_order(isa: str, heads: int, block: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The in-block order of vLLM's CPU cache kernel for ``isa``, read off the kernel itself."""
    from vllm import _custom_ops as ops

    blocks = []
    slots = torch.arange(block, dtype=torch.int64)
    for key, value in probe_inputs(heads, block, dim, dtype):
        scratch = torch.zeros(1, heads, block, 2 * dim, dtype=dtype)
        kc, vc = scratch.view(1, heads, 2 * block, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, 1.0, 1.0, "auto")
        blocks.append(scratch[0])
    return index_from_probe(blocks, heads, block, dim)


def cpu_block_writer(isa: str) -> Callable[[torch.Tensor, Sequence[int], torch.Tensor, torch.Tensor], None]:
    """Write ``k`` and ``v`` (``[kv_heads, n * block_size, head_dim]``) into engine blocks with vLLM's own
    CPU cache kernel for ``isa`` (the one its attention writes with): a strided pass at memory speed,
    whatever the ISA's in-block order (measured: 2 ms for 24 MiB on AMX, against 145 ms for the
    permutation in numpy)."""
    from vllm import _custom_ops as ops

    def write(cache: torch.Tensor, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        nb, heads, block, width = cache.shape
        kc, vc = cache.view(nb, heads, 2 * block, width // 2).chunk(2, dim=2)
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        slots = (ids[:, None] * block + torch.arange(block, dtype=torch.int64)).reshape(-1)
        if k.shape[1] != slots.numel():
            raise ValueError(f"K/V of {k.shape[1]} tokens do not fill {len(block_ids)} engine blocks of {block}")
        ops.cpu_attn_reshape_and_cache(k.transpose(0, 1), v.transpose(0, 1), kc, vc, slots, isa, 1.0, 1.0, "auto")

    return write


def cpu_block_order(isa: str | None, heads: int, block: int, dim: int,
                    dtype: torch.dtype) -> tuple[str | None, torch.Tensor | None]:
    """The ISA's in-block order as :func:`store.engines.vllm.layout.detect_layout` takes it: ``("vec", None)``
    for the known ``vec`` order (its faster path), ``("probed", index)`` for another.

    Raises:
        UnsupportedLayout: the kernel could not be asked for an ISA whose order kvwarm does not know, or
            it stores K and V as something other than a permutation of their elements.
    """
    try:
        index = probe_order(isa, heads, block, dim, dtype)  # type: ignore[arg-type]
    except UnsupportedLayout:
        raise
    except Exception as exc:  # noqa: BLE001 - the kernel could not be asked: trust the known order
        if isa not in VEC_ISAS:
            raise UnsupportedLayout(f"kvwarm could not read the CPU backend's block order for ISA {isa!r} "
                                    f"({exc})") from None
        log.warning("kvwarm: could not probe the CPU cache kernel (%s); using the known %s order", exc, isa)
        return isa, None
    if torch.equal(index, vec_index(heads, block, dim)):
        return "vec", None
    return "probed", index
