"""A loader given the model's config knows its layers: ``kv_cache.keep_layers`` past them are refused."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig

from store.config import parse_config
from store.errors import ConfigError
from store.serving.loader import KVLoader
from tests.store.pool_workers import ACME, TINY


def test_keep_layers_past_the_model_config_are_refused_when_the_loader_starts(tmp_path) -> None:
    mcfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    ok = parse_config({"kv_cache": {"keep_layers": [0, 1]}})
    with KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=ok, model_config=mcfg,
                  pool_bytes=1 << 20, pool_dir=tmp_path / "pool"):
        pass
    bad = parse_config({"kv_cache": {"keep_layers": [0, 2]}})
    with pytest.raises(ConfigError, match=r"kv_cache.keep_layers = \[0, 2\]: layer 2 is outside the loader's "
                                          r"model_config, which has 2 layers \(0 to 1\)"):
        KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, config=bad, model_config=mcfg,
                 pool_bytes=1 << 20, pool_dir=tmp_path / "pool")
