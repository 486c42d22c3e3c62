"""Stored blocks, engine caches and reservations sized to a chunk, for the chunked kernels' tests."""
from __future__ import annotations

import torch

from store.format.precision import Precision, quantize
from store.kernels.chunks import SLICES, load_block_bytes, save_block_bytes
from store.kernels.reservation import ALIGN, TABLE_BYTES, Reservation


def stored_parts(n: int, heads: int, tokens: int, dim: int, precision: Precision, seed: int,
                 layer: int = 0) -> list[list]:
    """K's and V's ``n`` stored blocks of ``layer`` as the codec stores each alone:
    ``[[(k_j, scale_j), ...], [(v_j, ...)]]``."""
    g = torch.Generator().manual_seed(seed)
    runs = []
    for _ in ("k", "v"):
        x = torch.randn((n, heads, tokens, dim), generator=g) * torch.where(
            torch.rand((n, heads, tokens, dim), generator=g) < 0.02, 30.0, 1.0)
        runs.append([quantize(x[j], precision, layer) for j in range(n)])
    return runs


def stacked(run: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One of :func:`stored_parts`' runs as ``[n, ...]`` tensors (what the whole-batch kernel takes)."""
    return torch.stack([p for p, _ in run]), None if run[0][1] is None else torch.stack([s for _, s in run])


def load_reservation(blocks: int, heads: int, tokens: int, dim: int, stored: torch.dtype,
                     cache: torch.dtype, group_tokens: int = 0) -> Reservation:
    """A CPU reservation whose chunks of a load hold exactly ``blocks`` kvwarm blocks."""
    per = load_block_bytes(heads, tokens, dim, stored, cache, group_tokens)
    return Reservation(TABLE_BYTES + SLICES * ALIGN + blocks * per + per // 2, "cpu")


def save_reservation(blocks: int, precision: Precision, heads: int, tokens: int, dim: int,
                     cache: torch.dtype) -> Reservation:
    """A CPU reservation whose chunks of a save hold exactly ``blocks`` kvwarm blocks."""
    per = save_block_bytes(precision, heads, tokens, dim, cache)
    return Reservation(TABLE_BYTES + SLICES * ALIGN + blocks * per + per // 2, "cpu")
