"""Write-back through a node, set up for the tests: an engine writer whose saves go through a ring to a
real node process, and one that writes them itself (what the node's files must equal)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from store.engines.vllm.metadata import SaveSpec
from store.engines.vllm.ring_saves import RingSaves
from store.engines.vllm.stats import Counters
from store.engines.vllm.tenancy import TenantBook
from store.engines.vllm.writeback import WriteBack
from store.format.precision import Precision
from store.node.client import NodeClient
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.engines.vllm.worker_setup import EB, IDENT, KB, NB, D, H, tokens
from tests.store.kernels.engine_caches import layout, random_cache

LAYERS = 3
RATIO = KB // EB
#: the blocks' creation time: now (whole seconds), so that the node's GC finds nothing expired
NOW = float(int(time.time()))


def caches(dtype: torch.dtype = torch.bfloat16) -> tuple[object, list[torch.Tensor]]:
    """An engine layout and its random per-layer caches."""
    lay = layout("cpu_vec", blocks=NB, heads=H, block=EB, dim=D, dtype=dtype, seed=3)
    return lay, [random_cache(lay, seed=10 + i) for i in range(LAYERS)]


def saves() -> list[SaveSpec]:
    """Two requests' saves in one step (an odd number of blocks each, blocks out of order)."""
    order = torch.randperm(NB, generator=torch.Generator().manual_seed(1)).tolist()
    return [SaveSpec("a", "acme", False, 0, tuple(tokens(3 * KB + 5, seed=1)), tuple(order[: 3 * RATIO])),
            SaveSpec("b", "acme", False, 1, tuple(tokens(6 * KB, seed=2)), tuple(order[3 * RATIO: 8 * RATIO]))]


def local_writer(tier: Path, config, lay, precision: Precision) -> WriteBack:  # type: ignore[no-untyped-def]
    """The engine's own writer on ``tier``."""
    return WriteBack(Store([LocalTier(tier, cap_bytes=1 << 30)]), TenantBook(config, "acme"), (IDENT, None),
                     precision, kv_block=KB, ttl_s=3600.0, layout=lay, counters=Counters(), clock=lambda: NOW)


def ring_writer(tier: Path, config, lay, precision: Precision, ring_dir: Path, *,  # type: ignore[no-untyped-def]
                ring_bytes: int = 16 << 20) -> WriteBack:
    """A writer on ``tier`` that hands its saves to the node at ``config.node.socket`` through a ring."""
    counters = Counters()
    book = TenantBook(config, "acme")
    handoff = RingSaves(NodeClient(config, autostart=False), book, (IDENT, None), precision, kv_block=KB, ttl_s=3600.0,
                        layout=lay, layers=LAYERS, counters=counters, ring_bytes=ring_bytes, ring_dir=ring_dir,
                        clock=lambda: NOW)
    return WriteBack(Store([LocalTier(tier, cap_bytes=1 << 30)]), book, (IDENT, None), precision, kv_block=KB,
                     ttl_s=3600.0, layout=lay, counters=counters, upload=False, handoff=handoff, clock=lambda: NOW)
