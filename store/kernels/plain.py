"""Layers stored unquantised (bf16/fp16: the layers mixed precision keeps, or bf16 storage), copied out of
whole snapshot payloads into ``[layers, 2 (K, V), heads, tokens, dim]``.

numpy, one pass per run of layers at regular steps and no OpenMP team: the stored bits, or converted
as :func:`store.format.precision.dequantize` converts. Used by
:meth:`store.kernels.dequant.Dequantizer.payload_layers` where the native gather did not copy them
(no native module, or an output dtype other than the stored one); a share (a tensor-parallel rank's
heads, a pipeline stage's layers) reads only its own bytes.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from store.format.runs import NP_SAME_SIZE, PayloadPlan
from store.kernels import memory
from store.kernels.table import bits_dtype


def _plain_pieces(plan: PayloadPlan, wanted: set[int] | None) -> list[tuple[int, int, int, int, int]]:
    """``(first, count, base, layer_step, kv_step)`` of the unquantised layers to read: each run whole
    (one strided copy), or, for a share, each wanted layer of it alone."""
    if wanted is None:
        return [(run.first, run.count, run.base, run.layer_step, run.kv_step) for run in plan.plain]
    return [(run.first + r, 1, run.base + r * run.layer_step, run.layer_step, run.kv_step) for run in plan.plain
            for r in range(run.count) if plan.plain_layers[run.first + r] in wanted]


def copy_plain(payloads: Sequence[np.ndarray], plan: PayloadPlan, tokens: int, dtype: torch.dtype, *,
               heads: tuple[int, int] | None = None, wanted: set[int] | None = None) -> torch.Tensor:
    """The unquantised layers to ``[layers, 2 (K, V), heads, tokens, dim]`` in ``dtype``.

    With ``heads`` (``(start, stop)``) and ``wanted`` (layer indices), only those heads of those
    layers are read and written (the other rows are left unwritten).
    """
    all_heads, bs, dim = plan.shape
    h0, h1 = heads if heads is not None else (0, all_heads)
    stored = plan.plain_dtype
    assert stored is not None
    esize = stored.itemsize
    out = memory.empty((len(plan.plain_layers), 2, h1 - h0, tokens, dim), dtype)
    # numpy, one pass and no OpenMP team: the stored bits, or bf16 -> fp32 as the bits moved
    # up 16 places (exactly what Tensor.to does); any other conversion through Tensor.copy_
    widen = stored == torch.bfloat16 and dtype == torch.float32
    dst = out.view(bits_dtype(dtype)).numpy() if stored == dtype or widen else None
    t = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mappings: torch cannot write to them
        for arr in payloads:
            nt = min(bs, tokens - t)
            if nt <= 0:
                break
            for first, count, base, layer_step, kv_step in _plain_pieces(plan, wanted):
                src = np.ndarray((count, 2, h1 - h0, nt, dim), dtype=NP_SAME_SIZE[esize], buffer=arr,
                                 offset=base + h0 * bs * dim * esize,
                                 strides=(layer_step, kv_step, bs * dim * esize, dim * esize, esize))
                rows = slice(first, first + count)
                if widen:
                    wide = dst[rows, :, :, t : t + nt].view(np.uint32)  # type: ignore[index]
                    np.left_shift(src.view(np.uint16), 16, out=wide, dtype=np.uint32)
                elif dst is not None:
                    np.copyto(dst[rows, :, :, t : t + nt], src)
                else:  # the conversion dequantize() makes (Tensor.to)
                    out[rows, :, :, t : t + nt].copy_(torch.from_numpy(src).view(stored))
            t += nt
    return out
