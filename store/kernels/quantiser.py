"""The codec's per-head FP8 quantisation of bf16 KV on the CPU, in one native pass.

:func:`store.kernels.gather.quantise_blocks` runs the codec's arithmetic as about ten torch
passes over each layer (widen, two reductions, divide, clamp, cast, the FP8 table, multiply,
subtract); on the CPU that is most of write-back's cost (~36 ms of a core for a 2,048-token
kvwarm-ref prompt here). The native module (``quantise_heads`` in ``store/kernels/_fp8gather.c``)
makes the same bits in one pass per head of each block, 16 values at a time with AVX-512 (a
plain loop elsewhere): the FP8 bytes, the scales, and the widened values and dequantised
difference whose norms make the recorded error. The two norms stay torch's reductions, so the
recorded errors are the codec's too. The temporaries are each thread's own, reused. Used for bf16 caches with per-head scales, on the CPU;
everything else keeps the torch passes.
"""
from __future__ import annotations

import threading

import torch

from store.kernels.reservation import Frame, Loose

try:  # optional: a source install without a C compiler has torch's passes only
    from store.kernels import _fp8gather as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None


def native_quantise() -> bool:
    """Whether the native pass is here."""
    return _native is not None and hasattr(_native, "quantise_heads")


#: the most bytes of one thread's two fp32 temporaries: blocks go through in chunks of at most this much
SCRATCH_BYTES = 16 << 20
_local = threading.local()


def _scratch(elements: int) -> torch.Tensor:
    """This thread's fp32 temporaries, ``[2, elements]``, reused from call to call (fresh memory faults in
    page by page: on this VM that cost the native pass 7x its time)."""
    got = getattr(_local, "buf", None)
    if got is None or got.shape[1] < elements:
        got = _local.buf = torch.empty((2, elements), dtype=torch.float32)
    return got


def quantise_heads(x: torch.Tensor, mem: Frame | Loose) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor] | None:
    """``x`` (``[n, kv_heads, tokens, head_dim]`` bf16 on the CPU) quantised per head: the FP8 values, the fp32
    scales ``[n, kv_heads]`` and, per block, the fp32 norms ``||dequantize(stored) - x||`` and ``||x||``
    (what :func:`store.kernels.gather.quantise_blocks` returns; results from ``mem``, temporaries this
    thread's, at most :data:`SCRATCH_BYTES`). ``None`` where the native pass does not apply (no native
    module, another dtype or device, ``x`` not contiguous): the caller then runs torch's passes."""
    if (not native_quantise() or x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 4
            or not x.is_contiguous() or x.numel() == 0):
        return None
    n, heads, tokens, dim = x.shape
    per = heads * tokens * dim
    stored = mem.take(x.shape, torch.float8_e4m3fn)
    scale = mem.take((n, heads), torch.float32)
    num, den = mem.take((n,), torch.float32), mem.take((n,), torch.float32)
    step = max(1, min(n, SCRATCH_BYTES // (8 * per)))
    scratch = _scratch(step * per)
    bits, codes = x.view(torch.int16).numpy(), stored.view(torch.uint8).numpy()
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        wide, back = (scratch[i, : (hi - lo) * per].view(hi - lo, per) for i in (0, 1))
        _native.quantise_heads(bits[lo:hi], wide.numpy(), codes[lo:hi], back.numpy(), scale[lo:hi].numpy(),
                               tokens * dim)
        # each block's norm is its own row's reduction (the rows a whole batch's norm would make)
        torch.linalg.vector_norm(back, dim=1, out=num[lo:hi])
        torch.linalg.vector_norm(wide, dim=1, out=den[lo:hi])
    return stored, scale, num, den
