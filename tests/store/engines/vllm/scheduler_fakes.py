"""vLLM-shaped plain objects for the scheduler role's tests, and a store of synthetic snapshots.

The fields are the ones vLLM 0.32 hands a connector (``Request``, ``NewRequestData``,
``CachedRequestData``, ``SchedulerOutput``); nothing here imports vLLM.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from store.config import KvwarmConfig, parse_config
from store.engines.vllm.scheduler import SchedulerRole
from store.engines.vllm.settings import ConnectorSettings
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.tiers.store import Store
from tests.store.factories import make_snapshot

KB, EB = 16, 8  # kvwarm's block and the engine's (two engine blocks per kvwarm block)
PLAIN = ModelIdentity("test-model@1", "tok-1", name="m")
CHAT = ModelIdentity("test-model@1", "tok-1", chat_template_hash="c" * 64, name="m")
#: bolt's vLLM cache_salt (16 characters at least, as every salt)
BOLT_SALT = "salt-bolt-0123456789abcdef"
#: acme is the roles' default tenant (requests without a cache_salt), so it lists no cache_salts (a
#: default tenant that does is refused: a request without a salt would act as it); bolt is selected by its salt
TENANTS = {"acme": {}, "bolt": {"cache_salts": [BOLT_SALT]}}


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    skip_reading_prefix_cache: bool = False


@dataclass
class NewReq:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class Out:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def config(s3: dict[str, Any] | None = None, *, trust_named: bool = False, **loader: Any) -> KvwarmConfig:
    return parse_config({"kv_cache": {"block_size": KB}, "tenants": {**TENANTS, "trust_named": trust_named},
                         "loader": loader, "store": {"s3": s3 or {}}})


def tokens(n: int, seed: int = 0) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(1000) for _ in range(n)]


def role(tmp_path: Path, *, tenant: str = "acme", write_back: bool = True, rate: float | None = None,
         chat: bool = True, cfg: KvwarmConfig | None = None, url: str | None = None, load_mode: str = "auto",
         **kw: Any) -> SchedulerRole:
    settings = ConnectorSettings(store_url=url or f"file://{tmp_path}/nvme", tenant=tenant, config=cfg or config(),
                                 model_dir=tmp_path, write_back=write_back, prefill_tokens_per_s=rate,
                                 load_mode=load_mode)
    return SchedulerRole(settings, identities=(PLAIN, CHAT if chat else None), engine_block=EB, layers=2,
                         kv_heads=2, head_dim=8, **kw)


def store_prefix(tmp_path: Path, ids: Sequence[int], *, namespace: str = "acme", chat: bool = False,
                 blocks: int | None = None, cfg: KvwarmConfig | None = None, url: str | None = None) -> None:
    """Write synthetic snapshots of ``ids``'s first ``blocks`` full blocks under ``namespace``'s chain
    (into the test's NVMe tier, or the tiers ``url`` names)."""
    cfg = cfg or config()
    tenant = cfg.tenant(namespace)
    precision = cfg.kv_cache.precision()
    root = (CHAT if chat else PLAIN).key_root(precision, KB, tenant.salt)
    store = Store.open(url or f"file://{tmp_path}/nvme", cfg, create_bucket=url is not None)
    for b in block_chain(root, ids)[:blocks]:  # public: the public writer (the prefill job) writes it
        store.put(tenant, make_snapshot(root, b, tenant=tenant, precision=precision))
    store.close()
