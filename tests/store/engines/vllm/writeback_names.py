"""The write-back engine tests' prompt and the object names its full blocks get."""
from __future__ import annotations

from store.config import load_config
from store.identity.fingerprint import identity_from_dir
from store.identity.keys import block_chain
from store.tiers.base import object_name
from tests.store.engines.vllm.harness import TENANT, tiny_dir
from tests.store.engines.vllm.prompts import all_ids

PROMPT = "written_back"  # 700 tokens: two full kvwarm blocks


def written_names(config) -> list[str]:  # type: ignore[no-untyped-def]
    """Object names of the prompt's full blocks under tenant acme's plain root."""
    cfg = load_config(config)
    root = identity_from_dir(tiny_dir()).key_root(cfg.kv_cache.precision(), cfg.kv_cache.block_size,
                                                  cfg.tenant(TENANT).salt)
    return [object_name(TENANT, b.key) for b in block_chain(root, all_ids()[PROMPT])]
