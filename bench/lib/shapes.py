"""Model shapes and device timing shared by the prefill and loader benchmarks.

``--shape 8b`` in either script builds an 8B-class Llama (32 layers, 8 KV heads, head
dim 128) with random bf16 weights on the chosen device, for the GPU checks of the
prefill and loader issues; ``8b-mini`` is a two-layer miniature to try the scripts on a CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch


def synced(fn, device: torch.device):
    """``fn`` followed by a device synchronise, so CUDA work is inside the timing."""
    if device.type != "cuda":
        return fn

    def run():
        out = fn()
        torch.cuda.synchronize(device)
        return out
    return run


#: Shapes for --shape: an 8B-class Llama (32 layers, 8 KV heads, head dim 128) and a
#: two-layer miniature of it that runs on a CPU (to check the script before a GPU run).
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=16384),
    "8b-mini": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, vocab_size=4096, max_position_embeddings=16384),
}


def shaped_model(shape: str, device: str, dtype: torch.dtype):
    """A randomly initialised Llama of ``shape`` built on ``device`` (nothing saved or downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefill.models import LoadedModel, load_model
    from store.identity.fingerprint import ModelIdentity

    tok = load_model("kvwarm-tiny").tokenizer  # only its pad id is used; ids are drawn at random
    cfg = LlamaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    dev = torch.device(device)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    ident = ModelIdentity(f"random-{shape}@seed0", "none", name=shape)
    return LoadedModel(name=shape, path=Path("."), model=model, tokenizer=tok, config=cfg, identity=ident,
                       chat_identity=None, device=dev, dtype=dtype)
