"""A serving process for the end-to-end test: loader lookup + to_dynamic_cache + generate.

Run as ``python -m tests.e2e_serving STORE_URL CONFIG MODEL_DIR DTYPE PROMPTS_JSON``;
prints one JSON object: per prompt the cold and the warm greedy tokens and the hit size.
"""
from __future__ import annotations

import json
import sys

import torch


def main(store_url: str, config_path: str, model_dir: str, dtype: str, prompts_json: str) -> None:
    from transformers import AutoModelForCausalLM

    from store.config import load_config
    from store.serving.loader import KVLoader

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    config = load_config(config_path)
    out = []
    with KVLoader(store_url, tenant="acme", model=model_dir, pool_bytes=256 << 20, config=config,
                  fetch_mode="sync") as loader:
        for ids in json.loads(prompts_json):
            x = torch.tensor([ids])
            with torch.no_grad():
                cold = model.generate(x, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, len(ids):]
                hit = loader.lookup(ids)
                cache = None
                if hit is not None:
                    with hit:
                        cache = hit.to_dynamic_cache("cpu", torch_dtype)
                warm = model.generate(x, cache=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, len(ids):]
            out.append({"cold": cold.tolist(), "warm": warm.tolist(), "hit_tokens": 0 if hit is None else hit.usable_tokens})
        stats = loader.stats()
    print(json.dumps({"results": out, "hits": stats.get("hits"), "lookups": stats.get("lookups")}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
