"""FP8 dequantisation by table: per head, the 256 possible results, then one gather.

An FP8 (e4m3) byte dequantised with a per-head scale has 256 possible values per head.
:func:`tables` computes them with the reference arithmetic of
:func:`store.precision.dequantize` (``fp32(value) * scale``, rounded once to the output
dtype), so a gather through them gives the reference bits by construction.

The gather itself is the native module ``store._fp8gather`` (built from
``store/_fp8gather.c`` at install; AVX-512 where the CPU has it, streaming stores into
new memory) when it is there, numpy's ``take`` otherwise. :func:`gather_parts` runs every
head of one stored part; :func:`gather_payloads` every FP8 part of whole snapshot
payloads straight from their mappings into the final ``[heads, tokens, dim]`` layout, in
one native call.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from store import memory
from store.payload_plan import NP_SAME_SIZE

if TYPE_CHECKING:
    from store.payload_plan import PayloadPlan

try:  # optional: a source install without a C compiler has numpy only
    from store import _fp8gather as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def native_isa() -> str | None:
    """The instruction set of the native gather (``"avx512bw"``, ``"scalar"``), or ``None`` when
    the module was not built (numpy is used then: the same bits, slower)."""
    return None if _native is None else _native.isa()


def tables(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """For each scale, the output value of every FP8 byte: ``[*scale.shape, 256]`` in ``dtype``."""
    return (_FP8_VALUES * scale.to(torch.float32)[..., None]).to(dtype)


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same size as ``dtype`` (2 or 4 bytes): copies and gathers of its bits."""
    return {2: torch.int16, 4: torch.int32}[dtype.itemsize]


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def gather_parts(out: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor) -> bool:
    """``out[h] = table_h[stored[h]]`` for each head ``h`` of one CPU part ``[heads, tokens, dim]``.

    ``stored`` is FP8 and ``scale`` one fp32 value per head. Returns ``False``, writing
    nothing, where this does not apply (another device, dtype or scale shape, a head whose
    ``[tokens, dim]`` is not contiguous in ``out``, or shapes that differ).
    """
    if not (out.device.type == "cpu" and stored.device.type == "cpu" and stored.dtype == torch.float8_e4m3fn
            and scale.dim() == 1 and out.element_size() in NP_SAME_SIZE and out.shape == stored.shape
            and scale.shape[0] == out.shape[0]):
        return False
    if out.numel() and (out.stride(-1) != 1 or out.stride(-2) != out.shape[-1]):
        return False
    if stored.numel() and (stored.stride(-1) != 1 or stored.stride(-2) != stored.shape[-1]):
        stored = stored.contiguous()
    heads = out.shape[0]
    lut = tables(scale, out.dtype).view(bits_dtype(out.dtype))
    if _native is None:
        idx = stored.view(torch.uint8).numpy()
        dst = out.view(bits_dtype(out.dtype)).numpy()
        lnp = lut.numpy()
        for h in range(heads):
            # mode="clip": indices are bytes, always in range; "raise" would buffer the output.
            np.take(lnp[h], idx[h], out=dst[h], mode="clip")
        return True
    count = out.shape[1] * out.shape[2]
    if count == 0:
        return True
    esize = out.element_size()
    src = stored.data_ptr() + np.arange(heads, dtype=np.uint64) * np.uint64(stored.stride(0))
    dst = out.data_ptr() + np.arange(heads, dtype=np.uint64) * np.uint64(out.stride(0) * esize)
    _native.gather(src, dst, np.full(heads, count, dtype=np.uint64), lut.numpy(), esize)
    return True


def gather_payloads(payloads: Sequence[np.ndarray], plan: "PayloadPlan", tokens: int,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """Every FP8 part of consecutive snapshot payloads, as ``[parts, heads, tokens, dim]`` in ``dtype``.

    ``payloads`` are whole payloads (``uint8`` arrays of the plan's layout, e.g. the
    mappings themselves) of consecutive blocks; part ``j`` is K or V of FP8 layer
    ``plan.fp8.layers[j // 2]``. One native call reads every head of every part of every
    block where it lies and writes it where it goes. Returns ``None`` without the native
    module, for output dtypes other than 2 or 4 bytes, or when the plan has no FP8 group.
    """
    group = plan.fp8
    esize = dtype.itemsize
    if _native is None or group is None or esize not in NP_SAME_SIZE or not payloads:
        return None
    heads, bs, dim = plan.shape
    n, m = len(payloads), len(group.data)
    nbytes = payloads[0].shape[0]
    data = np.asarray(group.data, dtype=np.uint64)
    scales = np.asarray(group.scales, dtype=np.int64)
    if (tokens < 1 or tokens > n * bs or int(data.max()) + heads * bs * dim > nbytes
            or int(scales.max()) + 4 * heads > nbytes
            or any(a.dtype != np.uint8 or a.shape != (nbytes,) or not a.flags.c_contiguous for a in payloads)):
        raise ValueError(f"payloads do not match the plan: {n} payloads of {nbytes} bytes for {tokens} tokens")
    # scales [n, m, heads]: each part's fp32 values, read from every payload at once
    at = (scales[:, None] + 4 * np.arange(heads)[None, :]).reshape(-1)
    raw = np.stack([a[at[:, None] + np.arange(4)] for a in payloads])  # [n, m*heads, 4] bytes
    scale = torch.from_numpy(raw.view(np.float32).reshape(n, m, heads))
    lut = tables(scale, dtype).view(bits_dtype(dtype))
    out = memory.empty((m, heads, tokens, dim), dtype)
    i = np.arange(n, dtype=np.uint64)[:, None, None]
    j = np.arange(m, dtype=np.uint64)[None, :, None]
    h = np.arange(heads, dtype=np.uint64)[None, None, :]
    base = np.asarray([_address(a) for a in payloads], dtype=np.uint64)[:, None, None]
    src = base + data[None, :, None] + h * np.uint64(bs * dim)
    dst = np.uint64(out.data_ptr()) + ((j * np.uint64(heads) + h) * np.uint64(tokens) + i * np.uint64(bs)) \
        * np.uint64(dim * esize)
    rows = np.minimum(bs, tokens - np.arange(n) * bs).clip(0).astype(np.uint64)  # the last block may end early
    count = np.broadcast_to(rows[:, None, None] * np.uint64(dim), (n, m, heads))
    _native.gather(np.ascontiguousarray(src).reshape(-1), np.ascontiguousarray(dst).reshape(-1),
                   np.ascontiguousarray(count).reshape(-1), lut.numpy().reshape(-1), esize)
    return out
