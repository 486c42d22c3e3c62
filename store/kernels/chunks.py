"""The device kernels driven chunk by chunk through one :class:`store.kernels.reservation.Reservation`.

Whatever the size of a load or a step's saves (one block or 128k tokens), the device memory they use
is the reservation's, no more: the blocks go through in chunks of as many kvwarm blocks as the
reservation holds the temporaries of (:func:`load_block_bytes`, :func:`save_block_bytes`), each chunk
in one :meth:`store.kernels.reservation.Reservation.frame`:

- a load (:func:`scatter_stored`): a chunk's stored bytes and scales staged into the reservation
  (:func:`store.kernels.staging.stage_runs`, through the bounded pinned slots), then
  :func:`store.kernels.scatter.dequantise_scatter` of the chunk into its engine blocks. A chunk
  boundary may fall inside an engine block's kvwarm block: each chunk writes the engine blocks
  its kvwarm blocks hold.
- write-back (:func:`quantise_to_host`): a chunk's blocks gathered and quantised
  (:func:`store.kernels.gather.gather_kv`, :func:`store.kernels.gather.quantise_blocks`) in the
  reservation, and only the stored bytes, scales and errors copied out, into host memory made once
  for the whole step (pinned on CUDA: the FP8 bytes are all that cross PCIe).

The bits are those of the whole-batch kernels: every block is computed alone in both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from store.errors import ConfigError
from store.format.precision import STORAGE_DTYPES, Precision
from store.kernels.gather import StoredBlocks, error_ratio, gather_kv, quantise_blocks
from store.kernels.reservation import ALIGN, Reservation
from store.kernels.scatter import dequantise_scatter
from store.kernels.staging import Staging, stage_runs

if TYPE_CHECKING:
    from store.engines.vllm.layout import EngineLayout

#: Room a chunk keeps for rounding each slice up to :data:`store.kernels.reservation.ALIGN` (at most this many).
SLICES = 40


def load_block_bytes(heads: int, tokens: int, dim: int, stored: torch.dtype, cache: torch.dtype,
                     group_tokens: int = 0) -> int:
    """Reservation bytes one kvwarm block of a load takes in :func:`scatter_stored`, one layer: its K and V
    as stored and their scales, then (for K, then again for V) the FP8 codes as int32, their fp32 values,
    each token's scale (per-group scales: ``group_tokens``) and the result in the cache's dtype."""
    e = heads * tokens * dim
    groups = -(-tokens // group_tokens) if group_tokens else 1
    wide = 4 * heads * groups * group_tokens if group_tokens else 0
    return 2 * e * stored.itemsize + 2 * heads * groups * 4 + e * (4 + 4 + cache.itemsize) + wide


def save_block_bytes(precision: Precision, heads: int, tokens: int, dim: int, cache: torch.dtype) -> int:
    """Reservation bytes one kvwarm block of a save takes in :func:`quantise_to_host`, one FP8 layer (the most a
    layer takes; one that mixed precision keeps takes less): its K and
    V gathered in the cache's dtype, then (for K, then again for V) the quantiser's fp32 copy and
    quotient, the stored bytes and their int32 codes (13 bytes a value; per group also the padded
    groups and their widened scales), and the per-head scales, norms and errors."""
    e = heads * tokens * dim
    g = precision.group_tokens if precision.granularity == "head_group" else 0
    groups = -(-tokens // g) if g else 1
    padded = 8 * heads * groups * g * dim if g else 0
    return 2 * e * cache.itemsize + 13 * e + padded + heads * groups * 4 * 8 + 64


def chunk_blocks(reservation: Reservation, per_block: int, what: str) -> int:
    """How many kvwarm blocks of ``per_block`` bytes a frame of ``reservation`` holds (at least one).

    Raises:
        ConfigError: not even one (``loader.device_scratch_bytes`` is smaller than one block's work).
    """
    room = reservation.usable - SLICES * ALIGN
    if per_block > room:
        raise ConfigError(f"loader.device_scratch_bytes = {reservation.size} cannot hold one kvwarm block's {what} "
                          f"({per_block + SLICES * ALIGN} bytes a layer); raise it to at least that")
    return room // per_block


def scatter_stored(cache: torch.Tensor, layout: EngineLayout, ids: torch.Tensor,
                   runs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None]]], *, skip: int,
                   staging: Staging, reservation: Reservation, group_tokens: int = 0) -> bool:
    """One layer's stored K and V (``runs``: K's ``n`` block parts, then V's, host memory) into engine blocks
    ``ids`` of ``cache``: engine block ``skip + i`` of the stored tokens into ``ids[i]``, chunk by chunk.
    ``group_tokens``: the precision's group size where the scales are per group.

    Returns ``False`` (nothing written) where the parts are not uniform (not one shape, dtype and kind of
    scales): the caller dequantises them another way.

    Raises:
        ConfigError: the reservation cannot hold one block's work.
        ValueError: as :func:`store.kernels.scatter.dequantise_scatter`.
    """
    stored0, scale0 = runs[0][0]
    heads, tokens, dim = stored0.shape
    n, m, ratio = len(runs[0]), ids.shape[0], tokens // layout.block_size
    if tokens % layout.block_size or skip < 0 or skip + m > n * ratio:
        raise ValueError(f"{n} stored blocks of {tokens} tokens do not hold engine blocks {skip}..{skip + m}")
    grouped = group_tokens if scale0 is not None and scale0.dim() == 2 else 0
    step = chunk_blocks(reservation, load_block_bytes(heads, tokens, dim, stored0.dtype, cache.dtype, grouped), "load")
    for lo in range(skip // ratio, -(-(skip + m) // ratio), step):
        hi = min(lo + step, n)
        first, last = max(lo * ratio, skip), min(hi * ratio, skip + m)  # the engine blocks this chunk writes
        with reservation.frame() as frame:
            staged = stage_runs([run[lo:hi] for run in runs], cache.device, staging, frame)
            if staged is None:
                if lo > skip // ratio:
                    raise ValueError("the stored parts of one layer are not uniform")
                return False
            (k, v), scales = staged
            dequantise_scatter(cache, layout, ids[first - skip : last - skip], k=k, v=v, skip=first - lo * ratio,
                               k_scale=None if scales is None else scales[0],
                               v_scale=None if scales is None else scales[1], group_tokens=group_tokens,
                               scratch=frame)
    return True


def quantise_to_host(cache: torch.Tensor, layout: EngineLayout, ids: torch.Tensor, *, ratio: int,
                     precision: Precision, layer: int, reservation: Reservation) -> StoredBlocks:
    """:func:`store.kernels.gather.gather_quantise` of one layer's kvwarm blocks (engine blocks ``ids``,
    ``ratio`` each, in token order), chunk by chunk in ``reservation``, into host memory made for all of
    them (pinned from CUDA; the copies are issued on the current stream and complete once an event
    recorded after them has happened).

    Raises:
        ConfigError: the reservation cannot hold one block's work.
        ValueError: as :func:`store.kernels.gather.gather_kv`.
    """
    if ids.shape[0] % ratio:
        raise ValueError(f"{ids.shape[0]} engine blocks are not whole kvwarm blocks of {ratio} engine blocks")
    H, D, tokens = layout.num_kv_heads, layout.head_dim, ratio * layout.block_size
    n = ids.shape[0] // ratio
    out = _host_blocks(n, H, tokens, D, precision, layer, pin=cache.device.type == "cuda")
    cuda = cache.device.type == "cuda"
    per = save_block_bytes(precision, H, tokens, D, cache.dtype)
    step = chunk_blocks(reservation, per, "write-back")
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        with reservation.frame() as frame:
            k, v = gather_kv(cache, layout, ids[lo * ratio : hi * ratio], ratio, frame)
            for row, (x, dst, dst_scale) in enumerate(((k, out.k, out.k_scale), (v, out.v, out.v_scale))):
                mark = frame.mark()  # V's temporaries reuse K's bytes, after K's copies on the stream's order
                q, scale, num, den = quantise_blocks(x, precision, layer, frame)
                dst[lo:hi].copy_(q, non_blocking=cuda)
                if dst_scale is not None and scale is not None:
                    dst_scale[lo:hi].copy_(scale, non_blocking=cuda)
                errors = error_ratio(num, den, frame.take((hi - lo,), torch.float64), frame)
                out.errors[row, lo:hi].copy_(errors, non_blocking=cuda)
                frame.release(mark)
    return out


def _host_blocks(n: int, heads: int, tokens: int, dim: int, precision: Precision, layer: int, *,
                 pin: bool) -> StoredBlocks:
    """Empty host tensors for ``n`` blocks of one layer as stored (pinned when ``pin``)."""
    dtype = precision.layer_dtype(layer)
    stored = STORAGE_DTYPES[dtype]

    def empty(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, pin_memory=pin)

    scales: tuple[int, ...] | None = None
    if dtype == "fp8_e4m3":
        scales = (n, heads) if precision.granularity == "head" else (n, heads, -(-tokens // precision.group_tokens))
    k_scale = None if scales is None else empty(scales, torch.float32)
    v_scale = None if scales is None else empty(scales, torch.float32)
    return StoredBlocks(empty((n, heads, tokens, dim), stored), k_scale, empty((n, heads, tokens, dim), stored),
                        v_scale, empty((2, n), torch.float64))
