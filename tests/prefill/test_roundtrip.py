"""Done-when 1 of the prefill issue: generation continuing from stored KV matches a cold prefill.

50 varied prompts (CC0 prompts, prefill/assets), the built-in model, greedy decoding of
20 new tokens. Stored losslessly (fp32 model, fp32 storage) the tokens must be the same.
Stored as FP8 the issue's target is 95 % agreement; the built-in model has random weights,
whose near-tied logits flip under any perturbation, so we measure and pin what it
achieves (see docs/precision.md) rather than claim the target.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from prefill.models import _corpus
from prefill.runner import PrefillOptions, Prefiller, PrefixRequest
from store.keys import block_chain
from store.store import Store
from store.tenant import Tenant
from tests.prefill.conftest import BLOCK, config_for

ACME = Tenant.derive("acme", "s3cret")
NEW_TOKENS = 20
#: Measured on kvwarm-tiny (random weights): 0.37 plain FP8, 0.77 with layer 0 kept in
#: bf16, 0.82 with layers 0-1, 0.90 with 0-2 (docs/precision.md). The floors catch a
#: broken quantiser or loader without claiming more than the model allows.
FP8_FLOOR = 0.30


def restored_cache(loaded, store, root, ids):
    """The DynamicCache of the longest stored strict prefix of ``ids`` (None when nothing is stored)."""
    blocks = block_chain(root, ids[:-1])  # strict prefix: generate() must compute at least one token
    n = store.probe(ACME, blocks, root).count
    if n == 0:
        return None, 0
    per_layer = [([], []) for _ in range(loaded.num_layers)]
    for b in blocks[:n]:
        snap = store.get(ACME, b, root)
        for i in range(loaded.num_layers):
            k, v = snap.layer(i, loaded.dtype)
            per_layer[i][0].append(k)
            per_layer[i][1].append(v)
    cache = DynamicCache(config=loaded.config)
    for i, (ks, vs) in enumerate(per_layer):
        cache.update(torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], layer_idx=i)
    return cache, n * BLOCK


def agreement(loaded, compression, tmp_path, n_prompts=50, **kv):
    cfg = config_for(compression, **kv)
    store = Store.open(f"file://{tmp_path / (compression + '-keep' + '_'.join(map(str, kv.get('keep_layers', []))))}", cfg)
    prompts = [loaded.encode(p)[: 6 * BLOCK + 5] for p in _corpus()[:n_prompts]]
    assert all(len(p) > BLOCK for p in prompts)
    opts = PrefillOptions(precision=cfg.kv_cache.precision(), block_size=BLOCK)
    Prefiller(loaded, store, opts).run([PrefixRequest(ACME, tuple(p), 3600.0, order=i) for i, p in enumerate(prompts)])
    root = loaded.key_root(cfg.kv_cache.precision(), BLOCK, ACME.salt)
    same = total = 0
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            cold = loaded.model.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            cache, n = restored_cache(loaded, store, root, ids)
            assert n >= BLOCK
            warm = loaded.model.generate(x, cache=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False)
        same += int((cold[0, len(ids):] == warm[0, len(ids):]).sum())
        total += NEW_TOKENS
    store.close()
    return same / total


def test_lossless_storage_reproduces_greedy_generation(tiny, tmp_path):
    assert agreement(tiny, "fp32", tmp_path) == 1.0


def test_bf16_storage_of_a_bf16_model_nearly_always_agrees(tiny_bf16, tmp_path):
    # not bitwise: CPU bf16 kernels round a prefix computed alone differently from the
    # same prefix inside the whole prompt, and random weights have near-ties
    # (20 prompts: bf16 matmuls are slow on CPUs without bf16 units)
    assert agreement(tiny_bf16, "bf16", tmp_path, n_prompts=20) >= 0.98


def test_fp8_storage_agreement(tiny, tmp_path):
    assert agreement(tiny, "fp8", tmp_path) >= FP8_FLOOR


def test_keeping_the_first_layer_unquantised_recovers_most_of_the_loss(tiny, tmp_path):
    plain = agreement(tiny, "fp8", tmp_path)
    mixed = agreement(tiny, "fp8", tmp_path, keep_layers=[0])
    assert mixed >= plain + 0.2
