"""The snapshots the store benchmark (``bench/store_bench.py``) writes and reads, and how it touches them.

Real snapshots (:func:`store.format.encode.build_snapshot`, FP8 with per-head fp32 scales)
of a Llama-3-8B-shaped layout (32 layers, 8 KV heads, head_dim 128: 128 parts), with the
block size chosen so that the payload is N MiB (16 tokens per MiB) plus 2 KiB of scales.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace

import numpy as np
import torch
import xxhash

from store.format.encode import EncodedSnapshot, build_snapshot
from store.format.precision import Precision
from store.identity.keys import KeyRoot, block_chain
from store.identity.tenant import Tenant
from store.tiers.base import object_name

MiB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKENS_PER_MIB = MiB // (LAYERS * 2 * KV_HEADS * HEAD_DIM)  # fp8: one byte per element -> 16
TENANT = Tenant.derive("bench", "bench-secret")


def make_snapshot(mib: int, seed: int = 0) -> EncodedSnapshot:
    """A real FP8 snapshot whose payload is ``mib`` MiB (plus 2 KiB of fp32 scales)."""
    precision = Precision()
    block_size = TOKENS_PER_MIB * mib
    root = KeyRoot("bench-llama-3-8b-shaped@1", "bench-tok", precision.kv_dtype, precision.scheme_id(),
                   block_size, TENANT.salt)
    block = block_chain(root, np.arange(block_size) % 128_000)[0]
    g = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, block_size, HEAD_DIM)
    kv = [(torch.randn(shape, generator=g, dtype=torch.bfloat16), torch.randn(shape, generator=g, dtype=torch.bfloat16))
          for _ in range(LAYERS)]
    return build_snapshot(root=root, block=block, tenant=TENANT.name, kv=kv, precision=precision,
                          created_at=time.time(), ttl_s=24 * 3600)


def uncached(snap: EncodedSnapshot) -> EncodedSnapshot:
    """A new EncodedSnapshot of the same header and buffers, as a prefill job hands over:
    nothing the store might cache on the object (header JSON, Arrow wrappers) survives from
    an earlier repetition, so each timed write pays for them once, as a real write does."""
    return EncodedSnapshot(replace(snap.header), snap.payload)


def fresh_name(tag: str) -> str:
    """A tier object name never used before (the tiers skip names they hold)."""
    key = hashlib.sha256(f"{tag}/{time.time_ns()}/{os.urandom(8).hex()}".encode()).hexdigest()
    return object_name(TENANT.name, key)


def touch_parts(snap) -> int:
    """Read every payload byte of an opened snapshot (what a consumer does, cheaply)."""
    acc = 0
    for part in snap.header.parts:
        acc ^= xxhash.xxh3_64_intdigest(snap.array(part.name))
    return acc


def touch_bytes(data) -> int:
    return xxhash.xxh3_64_intdigest(data)
