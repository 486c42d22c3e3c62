"""Small factories for store tests: tenants, key roots, chains and snapshots."""
from __future__ import annotations

import time

import torch

from store.format.encode import EncodedSnapshot, build_snapshot
from store.format.precision import Precision
from store.identity.keys import Block, KeyRoot, block_chain
from store.identity.tenant import Tenant

ACME = Tenant.derive("acme", "acme-secret")
BOLT = Tenant.derive("bolt", "bolt-secret")


def make_root(tenant: Tenant = ACME, *, precision: Precision = Precision(), block_size: int = 16,
              model: str = "test-model@1", tokenizer: str = "tok-1") -> KeyRoot:
    return KeyRoot(model, tokenizer, precision.kv_dtype, precision.scheme_id(), block_size, tenant.salt)


def make_chain(root: KeyRoot, n_blocks: int = 4, *, start: int = 0) -> list[Block]:
    return block_chain(root, list(range(start, start + n_blocks * root.block_size)))


def make_kv(root: KeyRoot, *, layers: int = 2, heads: int = 2, head_dim: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (heads, root.block_size, head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layers)]


def make_snapshot(root: KeyRoot, block: Block, *, tenant: Tenant = ACME, precision: Precision = Precision(),
                  ttl_s: float = 4 * 3600, created_at: float | None = None, layers: int = 2, heads: int = 2,
                  head_dim: int = 8, seed: int = 0) -> EncodedSnapshot:
    return build_snapshot(
        root=root, block=block, tenant=tenant.name,
        kv=make_kv(root, layers=layers, heads=heads, head_dim=head_dim, seed=seed),
        precision=precision, created_at=time.time() if created_at is None else created_at, ttl_s=ttl_s,
    )
