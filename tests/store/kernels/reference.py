"""Mapped snapshots of random KV and the per-part reference every dequantisation path must match bit for bit.

The reference is each part dequantised alone by :func:`store.format.precision.dequantize`
(tests/store/kernels/test_dequant.py, test_table.py).
"""
from __future__ import annotations

import torch

from store.format.encode import build_snapshot, snapshot_bytes
from store.format.payload import map_file
from store.format.precision import Precision, dequantize
from store.format.snapshot import Snapshot, read_snapshot
from tests.store.factories import ACME, make_chain, make_root

BS = 16
LAYERS = 5


def mapped(tmp_path, precision: Precision, n: int, *, layers: int = LAYERS, heads: int = 2, dim: int = 8,
           seed: int = 7) -> list[Snapshot]:
    """``n`` consecutive snapshots of random KV (outliers in K, as real keys have), written and mapped back."""
    root = make_root(precision=precision, block_size=BS)
    g = torch.Generator().manual_seed(seed)
    tmp_path.mkdir(parents=True, exist_ok=True)
    snaps = []
    for b in make_chain(root, n):
        kv = [(torch.randn((heads, BS, dim), generator=g) * (1 + 20 * (i == 0)),
               torch.randn((heads, BS, dim), generator=g)) for i in range(layers)]
        enc = build_snapshot(root=root, block=b, tenant=ACME.name, kv=kv, precision=precision, created_at=0.0,
                             ttl_s=60.0)
        path = tmp_path / f"{b.index}.kvw"
        path.write_bytes(snapshot_bytes(enc))
        snaps.append(read_snapshot(map_file(path)))
    return snaps


def reference(snaps: list[Snapshot], tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every part dequantised alone by store.format.precision.dequantize, concatenated: K.0, V.0, K.1, ..."""
    out = []
    for i in range(snaps[0].header.layout.num_layers):
        for name in ("k", "v"):
            parts = []
            for s in snaps:
                scale = s.tensor(f"{name}_scale.{i}") if f"{name}_scale.{i}" in s._parts else None
                parts.append(dequantize(s.tensor(f"{name}.{i}"), scale, dtype))
            out.append(torch.cat(parts, dim=1)[:, :tokens])
    return out


def same_bits(got: list[torch.Tensor] | None, want: list[torch.Tensor]) -> bool:
    assert got is not None, "the whole-payload path was not taken"
    assert len(got) == len(want)
    ints = {2: torch.int16, 4: torch.int32}
    return all(a.shape == b.shape and a.dtype == b.dtype
               and torch.equal(a.contiguous().view(ints[a.element_size()]), b.view(ints[b.element_size()]))
               for a, b in zip(got, want))


def payloads(snaps: list[Snapshot]):
    return [s.payload for s in snaps]
