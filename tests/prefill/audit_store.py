"""Stores for the audit tests: chains written by the real prefill job or through the real encoder, some with wrong KV.

Wrong KV is written under the block's right key through :func:`store.format.encode.build_snapshot`,
so it has a right checksum, a consistent header and an honest recorded error: only its numbers
are wrong, which no check but a recomputation can see. The ways it is wrong are the ways a
serving engine's write-back could go wrong: the block computed after another prefix (a paging
bug, a wrong chain), or another block's KV altogether.
"""
from __future__ import annotations

import random
import time
from typing import Any, Sequence

import torch

from prefill.models import LoadedModel
from prefill.runner import Prefiller, PrefillOptions, PrefixRequest
from store.config import KvwarmConfig
from store.format.encode import build_snapshot
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import Block, KeyRoot, block_chain
from store.identity.tenant import Tenant
from store.tiers.base import object_name
from store.tiers.store import Store
from tests.store.factories import ACME

#: the ways :func:`put_chain` can make a block's KV wrong
WRONG = ("garbage_prefix", "another_block")


def tokens(n_blocks: int, block: int, seed: int) -> list[int]:
    """``n_blocks`` blocks of random token ids (distinct seeds give distinct chains)."""
    rng = random.Random(seed)
    return [rng.randrange(4, 4000) for _ in range(n_blocks * block)]


def model_kv(loaded: LoadedModel, ids: Sequence[int]) -> Any:
    """The model's per-layer KV cache of ``ids`` (``.keys``/``.values``, ``[1, heads, tokens, dim]``)."""
    with torch.inference_mode():
        return loaded.model(torch.tensor([list(ids)]), use_cache=True).cache.layers


def _block_kv(layers: Any, index: int, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sl = slice(index * block, (index + 1) * block)
    return [(layer.keys[0, :, sl].clone(), layer.values[0, :, sl].clone()) for layer in layers]


def wrong_kv(loaded: LoadedModel, ids: Sequence[int], index: int, block: int, how: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Wrong KV for block ``index`` of ``ids``: computed after a garbage prefix of the same length
    (``garbage_prefix``; layer 0 is then right, the others are not), or the KV of other tokens
    at the same place (``another_block``)."""
    lo, hi = index * block, (index + 1) * block
    if how == "garbage_prefix":
        if index == 0:
            raise ValueError("block 0 has no prefix to get wrong")
        seq = tokens(index, block, seed=10_000 + index) + list(ids[lo:hi])
    elif how == "another_block":
        seq = list(ids[:lo]) + tokens(1, block, seed=20_000 + index)
    else:
        raise ValueError(f"unknown way {how!r}; one of {WRONG}")
    return _block_kv(model_kv(loaded, seq), index, block)


def put_chain(store: Store, loaded: LoadedModel, config: KvwarmConfig, ids: Sequence[int], *, source: str | None,
              wrong: dict[int, str] | None = None, tenant: Tenant = ACME, identity: ModelIdentity | None = None,
              only: Sequence[int] | None = None) -> list[Block]:
    """Write the blocks of ``ids`` (``only`` these indexes, or all) as an engine's write-back would:
    the model's KV, quantised by the real encoder with ``source`` in the header; the blocks in
    ``wrong`` (index -> one of :data:`WRONG`) get wrong KV under their right keys. ``identity``
    keys them for another model than ``loaded``."""
    precision, bs = config.kv_cache.precision(), config.kv_cache.block_size
    root = (identity or loaded.identity).key_root(precision, bs, tenant.salt)
    layers = model_kv(loaded, ids)
    blocks = block_chain(root, ids)
    for b in blocks:
        if only is not None and b.index not in only:
            continue
        how = (wrong or {}).get(b.index)
        kv = _block_kv(layers, b.index, bs) if how is None else wrong_kv(loaded, ids, b.index, bs, how)
        snap = build_snapshot(root=root, block=b, tenant=tenant.name, kv=kv, precision=precision,
                              created_at=time.time(), ttl_s=3600.0, source=source)
        assert store.put(tenant, snap)
    return blocks


def prefill_chain(store: Store, loaded: LoadedModel, config: KvwarmConfig, ids: Sequence[int],
                  tenant: Tenant = ACME) -> list[Block]:
    """Write the blocks of ``ids`` with the real prefill job (source ``prefill``)."""
    bs = config.kv_cache.block_size
    Prefiller(loaded, store, PrefillOptions(precision=config.kv_cache.precision(), block_size=bs)).run(
        [PrefixRequest(tenant=tenant, token_ids=tuple(ids), ttl_s=3600.0)])
    return block_chain(key_root(loaded, config, tenant), ids)


def key_root(loaded: LoadedModel, config: KvwarmConfig, tenant: Tenant = ACME) -> KeyRoot:
    return loaded.key_root(config.kv_cache.precision(), config.kv_cache.block_size, tenant.salt)


def names(blocks: Sequence[Block], tenant: Tenant = ACME) -> list[str]:
    """The object names of ``blocks`` in ``tenant``'s namespace."""
    return [object_name(tenant.name, b.key) for b in blocks]


def present(store: Store) -> set[str]:
    """Every object name some tier of ``store`` holds."""
    return {e.name for tier in store.tiers for e in tier.entries()}
