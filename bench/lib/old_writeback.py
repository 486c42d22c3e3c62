"""What write-back made of a save before the batched kernels, for comparing the files it writes.

:func:`store.engines.vllm.paging.take_blocks` copied the engine blocks out, ``unpack_blocks`` put them
in kvwarm's order on the writer thread, and :func:`store.format.encode.build_snapshot` quantised each
block alone and measured its error. Kept here, as it ran, as the reference
(tests/store/engines/vllm/test_writeback_bytes.py, bench/writeback_encode_bench.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.paging import take_blocks, unpack_blocks
from store.format.encode import EncodedSnapshot, build_snapshot
from store.format.header import WRITE_BACK
from store.format.precision import Precision
from store.identity.keys import Block, KeyRoot


def old_snapshots(caches: Sequence[torch.Tensor], layout: EngineLayout, block_ids: Sequence[int],
                  blocks: Sequence[Block], *, root: KeyRoot, tenant: str, precision: Precision, kv_block: int,
                  created_at: float, ttl_s: float) -> list[EncodedSnapshot]:
    """The snapshots of ``blocks`` (kvwarm blocks whose engine blocks are ``block_ids``), as write-back made them."""
    copies = [take_blocks(c, layout, list(block_ids), host=True) for c in caches]
    kv = [unpack_blocks(t, layout) for t in copies]
    out = []
    for j, block in enumerate(blocks):
        part = slice(j * kv_block, (j + 1) * kv_block)
        out.append(build_snapshot(root=root, block=block, tenant=tenant, kv=[(k[:, part], v[:, part]) for k, v in kv],
                                  precision=precision, created_at=created_at, ttl_s=ttl_s, source=WRITE_BACK))
    return out
