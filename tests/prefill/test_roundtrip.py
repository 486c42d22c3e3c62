"""Done-when 1 of the prefill issue: generation continuing from stored KV matches a cold prefill.

50 varied prompts (the CC0 prompts that the default model's training left out, see
prefill/training.py), the built-in model, greedy decoding of 20 new tokens. Stored
losslessly (fp32 model, fp32 storage) the tokens must be the same. Stored as FP8 with the
default configuration (mixed precision: layer 0 in bf16, every other layer FP8) the target
is 95 % token agreement. FP8 on every layer is measured too, with a floor (it agrees less:
layer 0 is where FP8 loses most; docs/concepts/precision.md).

The cold generations do not depend on the storage: each model's are computed once per prompt
for the module (:func:`cold_tokens`), and the default FP8 agreement once for the two tests
that compare with it (the ``fp8_mixed`` fixture).
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from prefill.models import _corpus
from prefill.runner import Prefiller, PrefillOptions, PrefixRequest
from store.identity.keys import block_chain
from store.identity.tenant import Tenant
from store.tiers.store import Store
from tests.prefill.factories import BLOCK, FP8_TARGET, config_for

ACME = Tenant.derive("acme", "s3cret")
NEW_TOKENS = 20
#: FP8 on every layer: measured 0.81 on the trained kvwarm-tiny (0.37 with random weights).
#: The floor catches a broken quantiser or loader without claiming more than FP8 allows.
PLAIN_FP8_FLOOR = 0.65


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


#: greedy tokens of a cold prefill, by (model, prompt); the model is kept so that its id stays its own
_COLD: dict[tuple[int, tuple[int, ...]], tuple[object, torch.Tensor]] = {}


def cold_tokens(loaded, ids) -> torch.Tensor:
    """The ``NEW_TOKENS`` greedy tokens ``loaded`` generates after ``ids`` with no cache (computed once)."""
    key = (id(loaded), tuple(ids))
    if key not in _COLD:
        with torch.no_grad():
            out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                        do_sample=False)
        _COLD[key] = (loaded, out[0, len(ids):])
    return _COLD[key][1]


def agreement(loaded, compression, tmp_path, n_prompts=50, **kv):
    cfg = config_for(compression, **kv)
    tag = compression + "".join(f"-{k}{'_'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in kv.items())
    store = Store.open(f"file://{tmp_path / tag}", cfg)
    prompts = [loaded.encode(p)[: 6 * BLOCK + 5] for p in _corpus()[:n_prompts]]
    assert all(len(p) > BLOCK for p in prompts)
    opts = PrefillOptions(precision=cfg.kv_cache.precision(), block_size=BLOCK)
    Prefiller(loaded, store, opts).run([PrefixRequest(ACME, tuple(p), 3600.0, order=i) for i, p in enumerate(prompts)])
    root = loaded.key_root(cfg.kv_cache.precision(), BLOCK, ACME.salt)
    same = total = 0
    for ids in prompts:
        cold = cold_tokens(loaded, ids)
        with torch.no_grad():
            cache, n = restored_cache(loaded, store, root, ids)
            assert n >= BLOCK
            warm = loaded.model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=NEW_TOKENS,
                                         min_new_tokens=NEW_TOKENS, do_sample=False)
        same += int((cold == warm[0, len(ids):]).sum())
        total += NEW_TOKENS
    store.close()
    return same / total


def test_lossless_storage_reproduces_greedy_generation(tiny, tmp_path):
    assert agreement(tiny, "fp32", tmp_path) == 1.0


def test_bf16_storage_of_a_bf16_model_gives_the_same_tokens(tiny_bf16, tmp_path):
    # 20 prompts: bf16 matmuls are slow on CPUs without bf16 units (all 50 agree too: 245 s
    # on the loaded 2-core machine, docs/concepts/precision.md). With random weights this was 99.3 %:
    # CPU bf16 kernels round a prefix computed alone differently from the same prefix inside
    # the whole prompt, which flipped near-tied logits; the trained model has no such ties here.
    assert agreement(tiny_bf16, "bf16", tmp_path, n_prompts=20) == 1.0


@pytest.fixture(scope="module")
def fp8_mixed(tiny, tmp_path_factory) -> float:
    """The agreement of FP8 storage as configured by default (layer 0 kept in bf16)."""
    return agreement(tiny, "fp8", tmp_path_factory.mktemp("fp8-mixed"))


def test_fp8_storage_agreement(fp8_mixed):
    assert config_for("fp8").kv_cache.keep_layers == (0,)  # what users get by default
    assert fp8_mixed >= FP8_TARGET


def test_fp8_on_every_layer_agrees_less_but_stays_above_a_floor(tiny, fp8_mixed, tmp_path):
    plain = agreement(tiny, "fp8", tmp_path, keep_layers=[])
    assert PLAIN_FP8_FLOOR <= plain < fp8_mixed
