"""Small factories and figures shared by the prefill tests (and the end-to-end test)."""
from __future__ import annotations

from store.config import KvwarmConfig, parse_config

BLOCK = 16
#: The prefill issue's target for FP8 storage (the default: layer 0 kept in bf16): the
#: share of greedy tokens a warm start must give exactly as a cold prefill does.
FP8_TARGET = 0.95


def config_for(compression: str = "fp8", block_size: int = BLOCK, **kv) -> KvwarmConfig:
    """A config with these ``kv_cache`` settings and defaults for the rest."""
    return parse_config({"kv_cache": {"compression": compression, "block_size": block_size, **kv}})
