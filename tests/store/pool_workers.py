"""Helpers for loader tests: a tiny real model, snapshots of its KV, and worker processes.

The workers run in separate processes (``python -m tests.store.pool_workers ...``) so
that the pool's sharing and budget are tested across real processes, as on a node.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from store.config import KvwarmConfig, parse_config
from store.format.encode import build_snapshot
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.identity.tenant import Tenant
from store.tiers.store import Store

TINY = ModelIdentity(model_fingerprint="kvwarm-test-tiny-llama@seed0", tokenizer_fingerprint="test-bytes", name="tiny")
ACME = Tenant.derive("acme", "acme-secret")


def config(block_size: int = 16, compression: str = "fp8", max_shared_instances: int = 8) -> KvwarmConfig:
    return parse_config({"kv_cache": {"block_size": block_size, "compression": compression,
                                      "max_shared_instances": max_shared_instances}})


def tiny_model(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A 2-layer Llama (2 kv heads, head_dim 16) from a config with a fixed seed; no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval(), cfg


def prompt(n: int, seed: int = 0, vocab: int = 384) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(vocab) for _ in range(n)]


def prefill_kv(model: Any, ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) of a cold prefill, each ``[kv_heads, tokens, head_dim]``."""
    with torch.no_grad():
        cache = model(torch.tensor([list(ids)]), use_cache=True).cache
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def write_prefix(store: Store, cfg: KvwarmConfig, model: Any, ids: Sequence[int], *, tenant: Tenant = ACME,
                 identity: ModelIdentity = TINY, ttl_s: float = 4 * 3600, created_at: float | None = None) -> int:
    """Prefill ``ids`` and write one snapshot per full block; returns the blocks written."""
    precision = cfg.kv_cache.precision()
    root = identity.key_root(precision, cfg.kv_cache.block_size, tenant.salt)
    kv = prefill_kv(model, ids)
    bs = cfg.kv_cache.block_size
    blocks = block_chain(root, ids)
    for b in blocks:
        sl = slice(b.index * bs, (b.index + 1) * bs)
        snap = build_snapshot(root=root, block=b, tenant=tenant.name, kv=[(k[:, sl], v[:, sl]) for k, v in kv],
                              precision=precision, created_at=time.time() if created_at is None else created_at,
                              ttl_s=ttl_s)
        store.put(tenant, snap)
    return len(blocks)


def synthetic_prefix(store: Store, cfg: KvwarmConfig, ids: Sequence[int], *, layers: int, heads: int, head_dim: int,
                     seed: int = 0, tenant: Tenant = ACME, identity: ModelIdentity = TINY) -> int:
    """Snapshots of random KV (for size- and sharing-tests where the model does not matter)."""
    precision = cfg.kv_cache.precision()
    root = identity.key_root(precision, cfg.kv_cache.block_size, tenant.salt)
    g = torch.Generator().manual_seed(seed)
    blocks = block_chain(root, ids)
    shape = (heads, cfg.kv_cache.block_size, head_dim)
    for b in blocks:
        kv = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layers)]
        store.put(tenant, build_snapshot(root=root, block=b, tenant=tenant.name, kv=kv, precision=precision,
                                         created_at=time.time(), ttl_s=4 * 3600))
    return len(blocks)


def pss_kib(pid: int) -> int:
    """Proportional set size of a process (kB), from /proc/PID/smaps_rollup."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise RuntimeError(f"no Pss line for pid {pid}")


# -- worker processes -----------------------------------------------------------

def _loader(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from store.serving.loader import KVLoader

    return KVLoader(f"file://{args.store}", tenant=ACME, model=TINY, pool_bytes=args.budget,
                    config=config(args.block_size, args.compression, args.max_instances), pool_dir=args.pool)


def _wait_for(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def _wait_for_count(directory: Path, pattern: str, n: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s  # a hang guard
    while len(list(directory.glob(pattern))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} {pattern} in {directory}")
        time.sleep(0.02)


def share(args: argparse.Namespace) -> int:
    """Attach, say ready, wait for 'go', look the prefix up, touch every byte, say loaded, hold until 'stop'."""
    loader = _loader(args)
    ids = json.loads(Path(args.ids).read_text())
    sync = Path(args.sync)
    (sync / f"ready.{os.getpid()}").touch()
    _wait_for(sync / "go")
    hit = loader.lookup(ids)
    if hit is None:
        print(json.dumps({"error": "miss", "stats": loader.stats()}), flush=True)
        return 1
    total = 0
    for snap in hit.snapshots:
        for part in snap.header.parts:
            total += int(snap.array(part.name).sum(dtype=np.uint64))  # touches every page
    (sync / f"loaded.{os.getpid()}").write_text(json.dumps({"tokens": hit.tokens, "sum": total,
                                                            "mapped": loader.stats()["bytes_mapped"]}))
    _wait_for(sync / "stop")
    hit.release()
    loader.close()
    return 0


def _still_pinned(loader, hit) -> bool:  # type: ignore[no-untyped-def]
    """Whether every snapshot of ``hit`` is still in the pool under the admission it was pinned with."""
    now = loader.pool.admissions(list(hit.names))
    return all(now.get(n) == a for n, a in zip(hit.names, hit.admissions))


def churn(args: argparse.Namespace) -> int:
    """Random lookups of random prefixes; while each hit is pinned, check it stays in the pool.

    Between a start barrier (``ready.<pid>``, then ``go`` in ``--sync``) and a closing one
    (``idle.<pid>``, once this worker holds nothing, until ``--workers`` are idle), runs
    ``--lookups`` lookups, holding up to four hits at a time. Then it sweeps: one two-block
    lookup of each prefix, released at once. Each sweep lookup must hit, since the others
    pin at most one two-block hit each by then; and one worker's sweep pins 20 distinct
    blocks one after another in a pool of 12, so it must evict.

    Prints one JSON line: lookups, hits, violations (pinned entries that vanished or budget
    overruns seen), the most pool bytes seen, and the sweep's hits and tokens.
    """
    loader = _loader(args)
    prefixes = json.loads(Path(args.ids).read_text())
    sync = Path(args.sync)
    rng = random.Random(args.seed)
    out = {"lookups": 0, "hits": 0, "pinned_evicted": 0, "over_budget": 0, "max_usage": 0, "bad_data": 0,
           "sweep_hits": 0, "sweep_tokens": 0}

    def note_usage() -> None:
        usage = loader.pool.usage()
        out["max_usage"] = max(out["max_usage"], usage)
        if usage > args.budget:
            out["over_budget"] += 1

    def check_data(hit) -> None:  # type: ignore[no-untyped-def]
        import xxhash

        for snap in hit.snapshots[:1]:
            part = snap.header.parts[0]
            if xxhash.xxh3_64_hexdigest(memoryview(snap.array(part.name))) != part.xxh3:
                out["bad_data"] += 1

    def release(hit) -> None:  # type: ignore[no-untyped-def]
        if not _still_pinned(loader, hit):
            out["pinned_evicted"] += 1
        hit.release()

    (sync / f"ready.{os.getpid()}").touch()
    _wait_for(sync / "go")
    held: list[Any] = []
    for _ in range(args.lookups):
        ids = rng.choice(prefixes)
        ids = ids[: rng.randint(1, len(ids) // args.block_size) * args.block_size + 1]
        hit = loader.lookup(ids)
        out["lookups"] += 1
        if hit is not None:
            out["hits"] += 1
            held.append(hit)
            check_data(hit)
        note_usage()
        while held and (len(held) > 3 or rng.random() < 0.5):
            release(held.pop(rng.randrange(len(held))))
        time.sleep(rng.random() * 0.003)  # varies the interleaving; nothing depends on it
    for h in held:
        release(h)
    (sync / f"idle.{os.getpid()}").touch()
    _wait_for_count(sync, "idle.*", args.workers)
    for ids in prefixes:
        hit = loader.lookup(ids[: 2 * args.block_size + 1])
        if hit is not None:
            out["sweep_hits"] += 1
            out["sweep_tokens"] += hit.tokens
            check_data(hit)
            note_usage()
            release(hit)
    out["stats"] = {k: v for k, v in loader.stats().items() if k in ("misses_by_reason", "shortened_by_reason")}
    print(json.dumps(out), flush=True)
    loader.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["share", "churn"])
    p.add_argument("--store", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-instances", type=int, default=8)
    p.add_argument("--compression", default="bf16")
    p.add_argument("--sync", default="")
    p.add_argument("--lookups", type=int, default=200)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    return share(args) if args.mode == "share" else churn(args)


if __name__ == "__main__":
    sys.exit(main())
