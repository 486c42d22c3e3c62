"""Write-back's device kernel: one layer's engine blocks gathered and stored as the codec stores them.

For one layer's engine cache and the engine block ids of ``n`` kvwarm blocks (``ratio`` engine
blocks each, in token order), :func:`gather_quantise` makes, with a handful of whole-tensor
operations wherever the cache lives (CPU or CUDA; no host synchronisation, no loop over blocks):

- the stored K and V of each block, ``[n, kv_heads, kv_block, head_dim]`` (FP8 e4m3, or the
  unquantised dtype of bf16/fp16/fp32 storage and of the layers mixed precision keeps), and their
  fp32 scales (``[n, kv_heads]``, or ``[n, kv_heads, groups]`` for ``head_group``): the bits
  :func:`store.format.precision.quantize` makes for each block alone;
- each block's relative L2 error, K's and V's (``[2, n]``, float64): the number
  :func:`store.format.encode.build_snapshot` records, ``relative_error(x, dequantize(q, scale))``
  (the norms are the same fp32 reductions over the same rows; the ratio is taken in float64, as
  that function takes it in Python).

Every result and temporary comes from a ``scratch`` where one is given (a
:class:`store.kernels.reservation.Frame` of the device's one reservation: :mod:`store.kernels.chunks`
drives these kernels chunk by chunk through it), else from torch's allocator.

The arithmetic is the codec's, step for step; only the order of passes and their buffers differ
(in place where it can be, and FP8 back to fp32 through a 256-entry table of the FP8 values, the
bits of the cast, ~4x faster than torch's cast on the CPU). On CUDA the bytes and scales are the
codec's bits (IEEE division, round-to-nearest-even casts); the errors are CUDA's reductions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from store.format.encode import StoredLayer
from store.format.precision import FP8_MAX, STORAGE_DTYPES, Precision
from store.kernels.quantiser import quantise_heads
from store.kernels.reservation import Frame, Loose
from store.kernels.tiles import transpose_k_out

if TYPE_CHECKING:
    from store.engines.vllm.layout import EngineLayout

#: The fp32 value of every FP8 (e4m3) byte: the bits of ``Tensor.to(torch.float32)``, as a table.
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


@dataclass(frozen=True)
class StoredBlocks:
    """One layer of ``n`` kvwarm blocks as stored (each block as :func:`store.format.precision.quantize`
    stores it alone).

    Attributes:
        k, v: ``[n, kv_heads, kv_block, head_dim]`` in the storage dtype.
        k_scale, v_scale: fp32 ``[n, kv_heads]`` (or ``[n, kv_heads, groups]``); ``None`` unquantised.
        errors: float64 ``[2, n]``: K's and V's relative L2 error per block.
    """

    k: torch.Tensor
    k_scale: torch.Tensor | None
    v: torch.Tensor
    v_scale: torch.Tensor | None
    errors: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the stored parts (K, V and their scales; the errors are not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.k_scale, self.v, self.v_scale)
                   if t is not None)

    def block(self, j: int) -> StoredLayer:
        """Block ``j`` of them, as :func:`store.format.encode.encode_snapshot` takes a layer."""
        return StoredLayer(self.k[j], None if self.k_scale is None else self.k_scale[j],
                           self.v[j], None if self.v_scale is None else self.v_scale[j])

    def to_host(self) -> StoredBlocks:
        """The same in host memory: itself on the CPU; from a device, pinned copies issued on the current
        stream (complete once an event recorded after them has happened)."""
        if self.k.device.type == "cpu":
            return self

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return StoredBlocks(host(self.k), host(self.k_scale), host(self.v), host(self.v_scale),  # type: ignore[arg-type]
                            host(self.errors))  # type: ignore[arg-type]


def stored_block_bytes(precision: Precision, layers: int, heads: int, tokens: int, dim: int) -> int:
    """Bytes of one kvwarm block's stored parts over ``layers`` layers (what :attr:`StoredBlocks.nbytes`
    counts for it)."""
    total = 0
    for layer in range(layers):
        dtype = precision.layer_dtype(layer)
        total += 2 * heads * tokens * dim * STORAGE_DTYPES[dtype].itemsize
        if dtype == "fp8_e4m3":
            groups = 1 if precision.granularity == "head" else -(-tokens // precision.group_tokens)
            total += 2 * heads * groups * 4
    return total


def block_ids(ids: Sequence[int] | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Engine block ids as the int64 tensor on ``device`` the kernels take (make it once per step)."""
    return torch.as_tensor(ids, dtype=torch.long).to(device, non_blocking=True)


def block_views(cache: torch.Tensor, layout: EngineLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every engine block, each a strided ``[num_blocks, kv_heads, block_size, head_dim]`` view."""
    H, B, D, nb = layout.num_kv_heads, layout.block_size, layout.head_dim, layout.num_blocks
    if layout.kind == "cpu_vec":  # per (block, head): K^T [D, B], then V [B, D]
        halves = cache.view(nb, H, 2, B * D)
        return halves[:, :, 0].unflatten(-1, (D, B)).transpose(-1, -2), halves[:, :, 1].unflatten(-1, (B, D))
    if layout.kind == "split":
        return cache[..., :D], cache[..., D:]
    if layout.kind == "kv_first":  # [2, num_blocks, B, H, D]
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    raise ValueError(f"unknown layout kind {layout.kind!r}")


def _index(ids: torch.Tensor, layout: EngineLayout, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices that pick ``[n, kv_heads, ratio, ...]`` out of ``[num_blocks, kv_heads, ...]``: block, head."""
    n = ids.shape[0] // ratio
    heads = torch.arange(layout.num_kv_heads, device=ids.device).view(1, -1, 1)
    return ids.view(n, 1, ratio), heads


def gather_kv(cache: torch.Tensor, layout: EngineLayout, ids: torch.Tensor,
              ratio: int, scratch: Frame | Loose | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the kvwarm blocks whose engine blocks are ``ids`` (``ratio`` per kvwarm block, in token
    order): each ``[n, kv_heads, ratio * block_size, head_dim]``, contiguous, in the engine's dtype.

    One indexed copy each, straight into kvwarm's order (no intermediate copy of the blocks), into
    ``scratch`` (a :class:`store.kernels.reservation.Frame`; by default torch's allocator).

    Raises:
        ValueError: ``len(ids)`` is not a multiple of ``ratio``, or the layout is unknown.
    """
    if ids.shape[0] % ratio:
        raise ValueError(f"{ids.shape[0]} engine blocks are not whole kvwarm blocks of {ratio} engine blocks")
    mem = scratch if scratch is not None else Loose(cache.device)
    H, B, D = layout.num_kv_heads, layout.block_size, layout.head_dim
    n = ids.shape[0] // ratio
    if layout.kind == "cpu_permuted":  # whole blocks (one row copy each), then their elements in kvwarm's order
        assert layout.index is not None
        E = layout.block_elements
        rows = mem.take((n * ratio, E), cache.dtype)
        torch.index_select(cache.view(layout.num_blocks, E), 0, ids, out=rows)
        out = []
        for half, run in enumerate(layout.index_runs):  # runs of consecutive elements move together
            starts = layout.index[half, ..., ::run].to(cache.device) // run  # [H, B, D / run]
            where = torch.arange(ratio, device=cache.device).view(1, ratio, 1, 1) * (E // run) + starts.unsqueeze(1)
            pieces = mem.take((n, where.numel(), run), cache.dtype)
            torch.index_select(rows.view(n, ratio * E // run, run), 1, where.reshape(-1), out=pieces)
            out.append(pieces.view(n, H, ratio * B, D))
        return out[0], out[1]
    out = []
    native_k = None
    if layout.kind == "cpu_vec" and cache.device.type == "cpu" and cache.element_size() == 2 and cache.is_contiguous():
        got = mem.take((n, H, ratio * B, D), cache.dtype)  # K un-transposed by the native tile transpose
        if transpose_k_out(cache.view(torch.int16).numpy().reshape(layout.num_blocks, H, 2 * B * D),
                           ids.numpy(), ratio, got.view(torch.int16).numpy()):
            native_k = got
    for half, (src, idx) in enumerate(zip(block_views(cache, layout), [list(_index(ids, layout, ratio))] * 2)):
        if half == 0 and native_k is not None:
            out.append(native_k)
            continue
        # into contiguous memory: advanced indexing alone lays its result out as its (strided) source
        got = mem.take((n, H, ratio, B, D), cache.dtype)
        torch.ops.aten.index.Tensor_out(src, idx, out=got)
        out.append(got.view(n, H, ratio * B, D))
    return out[0], out[1]


def quantise_blocks(x: torch.Tensor, precision: Precision, layer: int, scratch: Frame | Loose | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Store ``x`` (``[n, kv_heads, tokens, head_dim]``: ``n`` blocks of one layer's K or V) at ``precision``.

    Returns the stored tensor and scales (the bits of :func:`store.format.precision.quantize` of each
    block alone) and, per block, the fp32 norms ``||dequantize(stored) - x||`` and ``||x||`` (``[n]``
    each) that :func:`store.format.precision.relative_error` divides. Every result and temporary comes
    from ``scratch`` (a :class:`store.kernels.reservation.Frame`; by default torch's allocator).
    """
    mem = scratch if scratch is not None else Loose(x.device)
    n, heads, tokens, dim = x.shape
    f32 = torch.float32
    dtype = precision.layer_dtype(layer)
    if dtype == "fp8_e4m3" and precision.granularity == "head":
        native = quantise_heads(x, mem)  # the same bits in one native pass (bf16 on the CPU)
        if native is not None:
            return native
    xf = mem.take(x.shape, f32).copy_(x)  # Tensor.to's conversion
    if dtype != "fp8_e4m3":
        stored = mem.take(x.shape, STORAGE_DTYPES[dtype]).copy_(x)
        back = mem.take(x.shape, f32).copy_(stored).sub_(xf)
        return stored, None, _norm(back, mem), _norm(xf, mem)
    if precision.granularity == "head":
        scale = _scale(_abs_max(xf, (-2, -1), mem), mem)
        q = torch.div(xf, scale[..., None, None], out=mem.take(x.shape, f32))
        wide = scale[..., None, None]
    else:
        g = precision.group_tokens
        groups = -(-tokens // g)
        xp = mem.take((n, heads, groups * g, dim), f32)  # torch.nn.functional.pad's zeros, then xf
        xp[:, :, tokens:].zero_()
        xp[:, :, :tokens].copy_(xf)
        scale = _scale(_abs_max(xp.view(n, heads, groups, g, dim), (-2, -1), mem), mem)
        qp = torch.div(xp.view(n, heads, groups, g, dim), scale[..., None, None], out=xp.view(n, heads, groups, g, dim))
        q = qp.view(n, heads, groups * g, dim)[:, :, :tokens]
        if groups * g != tokens:
            q = mem.take(x.shape, f32).copy_(q)
        wide = mem.take((n, heads, groups, g), f32).copy_(scale[..., None].expand(n, heads, groups, g))
        wide = wide.view(n, heads, groups * g)[..., :tokens, None]
    q.clamp_(-FP8_MAX, FP8_MAX)
    stored = mem.take(x.shape, torch.float8_e4m3fn).copy_(q)
    # back to fp32 (the bits of Tensor.to: the table holds the 256 FP8 values), then dequantize's product
    codes = mem.take((stored.numel(),), torch.int32).copy_(stored.view(torch.uint8).view(-1))
    back = torch.index_select(mem.fp8_values, 0, codes, out=q.view(-1))
    back = back.view(n, heads, tokens, dim).mul_(wide).sub_(xf)
    return stored, scale, _norm(back, mem), _norm(xf, mem)


def _scale(amax: torch.Tensor, mem: Frame | Loose) -> torch.Tensor:
    """``where(amax > 0, amax / FP8_MAX, 1)``: the codec's scales, into ``mem``."""
    scale = torch.div(amax, FP8_MAX, out=mem.take(amax.shape, torch.float32))
    none = torch.gt(amax, 0, out=mem.take(amax.shape, torch.bool)).logical_not_()  # a NaN is no scale either
    return scale.masked_fill_(none, 1.0)


def _abs_max(x: torch.Tensor, dims: tuple[int, ...], mem: Frame | Loose) -> torch.Tensor:
    """``x.abs().amax(dims)`` from two read-only reductions, without the ``abs`` copy: the same value
    (a NaN anywhere is NaN, as both propagate it; a signed zero is no scale: ``amax > 0`` is false)."""
    shape = tuple(s for i, s in enumerate(x.shape) if i - x.dim() not in dims)
    hi = torch.amax(x, dim=dims, out=mem.take(shape, torch.float32))
    lo = torch.amin(x, dim=dims, out=mem.take(shape, torch.float32))
    return torch.maximum(hi, lo.neg_(), out=hi)


def _norm(x: torch.Tensor, mem: Frame | Loose) -> torch.Tensor:
    """Each block's fp32 L2 norm over its contiguous ``[kv_heads, tokens, head_dim]`` (the reduction
    :func:`store.format.precision.relative_error` makes of one block)."""
    return torch.linalg.vector_norm(x.flatten(1), dim=1, out=mem.take((x.shape[0],), torch.float32))


def error_ratio(num: torch.Tensor, den: torch.Tensor, out: torch.Tensor, mem: Frame | Loose) -> torch.Tensor:
    """``num / den`` in float64 (``num`` where ``den`` is 0) into ``out``, as relative_error divides Python floats:
    each block's relative error from :func:`quantise_blocks`' norms (temporaries from ``mem``)."""
    f64 = torch.float64
    num64 = mem.take(num.shape, f64).copy_(num)
    den64 = mem.take(den.shape, f64).copy_(den)
    pos = torch.gt(den64, 0, out=mem.take(den.shape, torch.bool))
    den64.masked_fill_(pos.logical_not_(), 1.0)
    quotient = torch.div(num64, den64, out=mem.take(num.shape, f64))
    return torch.where(pos.logical_not_(), quotient, num64, out=out)


def gather_quantise(cache: torch.Tensor, layout: EngineLayout, ids: torch.Tensor, *, ratio: int,
                    precision: Precision, layer: int) -> StoredBlocks:
    """One layer's kvwarm blocks (engine blocks ``ids``, ``ratio`` each, in token order) as stored, with
    their errors: :func:`gather_kv` then :func:`quantise_blocks` of K and V, where ``cache`` lives.

    Raises:
        ValueError: as :func:`gather_kv`.
    """
    return quantise_kv(*gather_kv(cache, layout, ids, ratio), precision=precision, layer=layer)


def quantise_kv(k: torch.Tensor, v: torch.Tensor, *, precision: Precision, layer: int) -> StoredBlocks:
    """One layer's gathered K and V (:func:`gather_kv`) as stored, with their errors (the second half of
    :func:`gather_quantise`: on a CPU cache the write-back runs it on its writer thread, not the engine's)."""
    mem = Loose(k.device)
    errors = mem.take((2, k.shape[0]), torch.float64)
    kq, ks, kn, kd = quantise_blocks(k, precision, layer, mem)
    vq, vs, vn, vd = quantise_blocks(v, precision, layer, mem)
    error_ratio(kn, kd, errors[0], mem)
    error_ratio(vn, vd, errors[1], mem)
    return StoredBlocks(kq, ks, vq, vs, errors)


def quantise_taken(taken: torch.Tensor, layout: EngineLayout, *, ratio: int, precision: Precision,
                   layer: int) -> StoredBlocks:
    """One layer's blocks as :func:`store.engines.vllm.paging.take_blocks` copied them (whole engine blocks, in
    the engine's layout, in token order), as stored: :func:`gather_quantise` over that copy, a cache of just
    those blocks, so the same bits (what write-back runs on its writer thread for a CPU cache)."""
    n = taken.shape[1] if layout.kind == "kv_first" else taken.shape[0]
    small = replace(layout, num_blocks=n)
    return gather_quantise(taken, small, torch.arange(n, device=taken.device), ratio=ratio, precision=precision,
                           layer=layer)
