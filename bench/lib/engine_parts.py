"""The engine bench's parts: prompts, configs, the prefill job on them, the driver's steps (bench/engine_bench.py).

Shared by the bench's kvwarm columns and its LMCache comparison (:mod:`bench.lib.engine_lmcache`).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from bench.lib.bench_node import node_section

BLOCK = 256  # kvwarm's block size (the config default)
#: the SeaweedFS credentials the benches' kvwarm S3 tiers read (from these variables) and LMCache's adapter is given
S3_ENV = {"KVWARM_BENCH_S3_KEY": "test", "KVWARM_BENCH_S3_SECRET": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def prompts(n: int, prefix: int, new: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``prefix + new`` token ids, distinct from their first block on."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (prefix + new,), generator=g).tolist() for _ in range(n)]


def write_config(path: Path, store_url: str, compression: str) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "kv_cache": {"compression": compression, "block_size": BLOCK},
        "store": {"url": store_url},
        "loader": {"pool_dir": str(path.parent / "pool"), "pool_bytes": "8GiB"},
        "node": node_section(path.parent),
    }))
    return path


def prefill_prefixes(model_dir: Path, config: Path, prefixes: list[list[int]], device: str,
                     tenant: str = "public") -> dict:
    """The real prefill job (``prefill.warm.warm``, as ``prefill warm`` runs it) on the prefixes."""
    from prefill.models import load_model
    from prefill.warm import warm
    from store.config import load_config
    from store.plan import PlanEntry
    from store.tiers.store import Store

    cfg = load_config(config)
    # fp32 on a CPU: bf16 matmuls have no native path on AVX2 hosts (minutes per 2k tokens); the
    # stored precision is the config's either way
    loaded = load_model(str(model_dir), dtype="fp32" if device == "cpu" else "bf16", device=device)
    store = Store.open(cfg.store.url, cfg)
    try:
        r = warm([PlanEntry(tenant=tenant, token_ids=tuple(p)) for p in prefixes], loaded=loaded, store=store,
                 config=cfg)
    finally:
        store.close()
    return {"blocks_written": r.blocks_written, "seconds": r.seconds, "by": "prefill"}


def random_prefixes(model_dir: Path, config: Path, prefixes: list[list[int]]) -> dict:
    """Snapshots of random KV of the model's geometry under its keys (timing only, any size, no model run)."""
    import torch

    from store.config import load_config
    from store.format.encode import build_snapshot
    from store.identity.fingerprint import identity_from_dir
    from store.identity.keys import block_chain
    from store.identity.tenant import PUBLIC_TENANT
    from store.tiers.store import Store

    cfg = load_config(config)
    geo = json.loads((model_dir / "config.json").read_text())
    heads, dim = geo["num_key_value_heads"], geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    precision = cfg.kv_cache.precision()
    root = identity_from_dir(model_dir).key_root(precision, BLOCK, PUBLIC_TENANT.salt)
    g = torch.Generator().manual_seed(0)
    t0, written = time.perf_counter(), 0
    store = Store.open(cfg.store.url, cfg)
    try:
        for ids in prefixes:
            for b in block_chain(root, ids):
                kv = [(torch.randn(heads, BLOCK, dim, generator=g).bfloat16(),
                       torch.randn(heads, BLOCK, dim, generator=g).bfloat16()) for _ in range(geo["num_hidden_layers"])]
                store.put(PUBLIC_TENANT, build_snapshot(root=root, block=b, tenant="public", kv=kv, precision=precision,
                                                        created_at=time.time(), ttl_s=cfg.kv_cache.ttl_seconds()))
                written += 1
    finally:
        store.close()
    return {"blocks_written": written, "seconds": time.perf_counter() - t0, "by": "random KV"}


def shaped_model_dir(shape: str, work: Path) -> Path:
    """A saved Llama of ``shape`` (bench/lib/shapes.py) with random bf16 weights and the tiny tokenizer.

    Under ``work``; or, with ``$KVWARM_SHAPED_MODELS`` set, under that directory, saved once and reused by
    later runs (an 8B model is 16 GB to write: bench/gpu_check.sh runs several benches on one).
    """
    import os

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.lib.shapes import SHAPES
    from prefill.models import resolve

    keep = os.environ.get("KVWARM_SHAPED_MODELS")
    d = (Path(keep) if keep else work) / f"model-{shape}"
    if keep and (d / "saved").is_file():
        return d
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(torch.bfloat16)
    model.save_pretrained(d)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve("kvwarm-tiny") / name, d / name)
    (d / "saved").write_text(shape)  # complete: a later run may reuse it
    return d


def ttft_step(ids: list[list[int]], name: str) -> dict:
    return {"name": name, "requests": [{"ids": p, "max_tokens": 1} for p in ids]}


#: after an engine's warm-up request: at most 30 s until the machine idles, so that the warm-up's own background
#: work (its write-back and upload, a peer server's store, the stand-in S3's PUT) is not in the first measured one
SETTLE = {"name": "settle", "quiet_s": 30.0}


def rounded(seconds: list[float]) -> list[float]:
    return [round(x, 4) for x in seconds]


def outcome_tokens(call: dict) -> int | None:
    """The tokens kvwarm loaded for a request (its ``kv_transfer_params``)."""
    return ((call.get("kv_transfer_params") or {}).get("kvwarm") or {}).get("loaded_tokens")


def engine_bytes_per_token(model_dir: Path) -> int:
    """Bytes of K and V per token in the engine's bf16 paged cache, all layers."""
    geo = json.loads((model_dir / "config.json").read_text())
    dim = geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    return geo["num_hidden_layers"] * 2 * geo["num_key_value_heads"] * dim * 2
