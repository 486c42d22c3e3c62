"""``make demo`` / ``prefill demo``: the part of the pipeline that exists today.

Builds a tiny Llama-architecture model offline (fixed seed), prefills a shared system
prompt, writes one FP8 snapshot per full block to a local store, then, as a serving
node would, probes the store for the longest stored prefix of a new request, maps the
blocks back, continues the model from the restored cache and compares the next-token
distribution with a cold prefill. (The flows issue turns this into the whole
pipeline: mine, forecast, plan, prefill, replay.)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from store.cli import add_location_options
from store.config import load_config
from store.errors import BadInputError
from store.format.encode import build_snapshot
from store.format.header import PREFILL
from store.identity.keys import KeyRoot, block_chain
from store.tiers.store import Store

SYSTEM_PROMPT = (
    "You are a support assistant for an online bookshop. Answer politely and briefly, "
    "quote order numbers exactly, never promise refunds before checking the order, and "
    "escalate to a human when the customer asks twice. "
)
QUESTION = "Where is my order 4471? It was due on Monday."
#: where the demo's store goes by default, in the current directory (the URL names it absolutely)
DEMO_DIR = ".kvwarm-demo"


def demo_store() -> str:
    """The default store URL: ``file://`` and the absolute path of :data:`DEMO_DIR` here."""
    return f"file://{Path(DEMO_DIR).resolve()}"


def tiny_model() -> tuple[Any, Any]:
    """A 2-layer Llama built from a config with a fixed seed (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), cfg


def byte_tokens(text: str) -> list[int]:
    """UTF-8 bytes as token ids (the trained tokenizer arrives with the prefill issue)."""
    return list(text.encode("utf-8"))


def run(store_url: str, tenant_name: str = "demo", block_size: int = 32, config_path: str | None = None) -> dict[str, float]:
    """Write snapshots of the system prompt, read them back, and measure the effect.

    Raises:
        BadInputError: a bad config, tenant, store URL, or a block size that leaves the
            prompt no full block (checked before the model is built).
    """
    from transformers import DynamicCache

    prompt = byte_tokens(SYSTEM_PROMPT)
    if not 1 <= block_size <= len(prompt):
        raise BadInputError(f"--block-size must be between 1 and {len(prompt)} (the demo prompt's tokens), "
                            f"got {block_size}")
    config = load_config(config_path)
    precision = config.kv_cache.precision()
    tenant = config.tenant(tenant_name)
    root = KeyRoot("demo-tiny-llama@seed0", "utf8-bytes", precision.kv_dtype, precision.scheme_id(), block_size, tenant.salt)
    store = Store.open(store_url, config)
    model, cfg = tiny_model()
    precision.check_layers(cfg.num_hidden_layers, model="the demo's model")

    # 1. Prefill job: compute the system prompt's KV and write one snapshot per full block.
    blocks = block_chain(root, prompt)
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).cache
    t0 = time.perf_counter()
    written = 0
    for b in blocks:
        sl = slice(b.index * block_size, (b.index + 1) * block_size)
        kv = [(layer.keys[0, :, sl], layer.values[0, :, sl]) for layer in cache.layers]
        snap = build_snapshot(root=root, block=b, tenant=tenant.name, kv=kv, precision=precision,
                              created_at=time.time(), ttl_s=config.kv_cache.ttl_seconds(), source=PREFILL)
        written += store.put(tenant, snap)
    write_s = time.perf_counter() - t0
    print(f"wrote {written} new snapshot(s) ({len(blocks)} blocks of {block_size} tokens, {precision.scheme_id()}) "
          f"to {store_url} in {write_s * 1000:.1f} ms")

    # 2. Serving node: a request that starts with the system prompt.
    request = prompt + byte_tokens(QUESTION)
    req_blocks = block_chain(root, request)
    hit = store.probe(tenant, req_blocks, root)
    n = hit.count * block_size
    print(f"request of {len(request)} tokens: {hit.count} leading block(s) = {n} tokens found in tier {hit.tier}")
    t0 = time.perf_counter()
    restored = DynamicCache(config=cfg)
    per_layer: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(cfg.num_hidden_layers)]
    for b in req_blocks[: hit.count]:
        snap = store.get(tenant, b, root)
        if snap is None:
            break
        for i in range(cfg.num_hidden_layers):
            per_layer[i].append(snap.layer(i, torch.float32))
    for i, parts in enumerate(per_layer):
        k = torch.cat([p[0] for p in parts], dim=1)[None]
        v = torch.cat([p[1] for p in parts], dim=1)[None]
        restored.update(k, v, layer_idx=i)
    load_s = time.perf_counter() - t0
    with torch.no_grad():
        warm = model(torch.tensor([request[n:]]), cache=restored).logits[0, -1]
        cold = model(torch.tensor([request])).logits[0, -1]
    lp_w, lp_c = torch.log_softmax(warm, -1), torch.log_softmax(cold, -1)
    rel = float((lp_w - lp_c).norm() / lp_c.norm())
    same_top1 = bool(warm.argmax() == cold.argmax())
    print(f"loaded {hit.count} block(s) in {load_s * 1000:.1f} ms; prefilled only {len(request) - n} of {len(request)} tokens")
    print(f"next-token log-probs vs cold prefill: relative L2 change {rel:.2e}, top-1 agrees: {same_top1}")
    print(f"store counters: {store.stats.as_dict()}")
    store.close()
    return {"blocks": float(hit.count), "rel_logprob_change": rel, "top1_agrees": float(same_top1)}


def add_demo_command(sub: Any) -> None:
    """Register ``prefill demo``."""
    p = sub.add_parser("demo", help="write snapshots from a tiny model and read them back",
                       description="Prefill a system prompt on a tiny random Llama, write one FP8 snapshot per block, "
                                   "then load them back as a serving node would and compare the next-token "
                                   "distribution with a cold prefill. Exit 1 when the top token disagrees.")
    add_location_options(p, store_help=f"store URL to write the demo's snapshots to (default: ./{DEMO_DIR}, "
                         "in the current directory)")
    p.add_argument("--tenant", default="demo", metavar="NAME", help="tenant to write as (default: demo)")
    p.add_argument("--block-size", type=int, default=32, metavar="TOKENS", help="tokens per block (default: 32, since the demo's prompt is short; the config's "
                        "kv_cache.block_size is not used)")
    p.set_defaults(func=lambda a: 0 if run(a.store or demo_store(), a.tenant, a.block_size, a.config)["top1_agrees"]
                   else 1)


if __name__ == "__main__":
    from prefill.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
