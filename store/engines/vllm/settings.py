"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked before anything starts.

Keys (docs/guides/engines.md documents each):

- ``store``: the store URL (tiers, as everywhere in kvwarm); default the config's ``store.url``.
- ``tenant``: the tenant of requests that name none (``public`` by default, as ``prefill warm``); it
  must list no cache salts (a request without a salt would act as it).
- ``config``: a kvwarm config file (``$KVWARM_CONFIG`` otherwise).
- ``model``: the model directory (or hub id) to fingerprint; default the model vLLM serves.
- ``write_back``: write the full prompt blocks the engine computes to the store (default true).
- ``plan``: a plan file, or ``latest`` (the plan last published to the store), prefetched at start-up.
- ``prefill_tokens_per_s``: the engine's prefill rate, until the connector has measured it.
- ``load_mode``: ``sync`` (a hit is loaded before the forward of the step that computes the rest
  of the request), ``async`` (the request waits a step for its load), ``auto`` (the default:
  ``async`` when vLLM's async scheduling is on, else ``sync``), or ``off`` (nothing is loaded: the
  engine only writes back, and vLLM may keep full CUDA graphs).

An unknown key or a bad value raises :class:`ConnectorConfigError` naming
``kv_connector_extra_config.<key>``: vLLM stops its start with that message. Pure: no vLLM here.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from store.config import KvwarmConfig, load_config
from store.engines.vllm.tenancy import check_default_tenant
from store.errors import ConfigError
from store.identity.fingerprint import IdentityError, ModelIdentity, identity_from_dir
from store.identity.tenant import check_tenant_name

PREFIX = "kv_connector_extra_config"
KEYS = ("store", "tenant", "config", "model", "write_back", "plan", "prefill_tokens_per_s", "load_mode")
LATEST = "latest"
LOAD_MODES = ("auto", "sync", "async", "off")


class ConnectorConfigError(ConfigError):
    """The connector cannot start as configured; the message names the key and what to do."""


@dataclass(frozen=True)
class ConnectorSettings:
    """The checked extra config, with the kvwarm config it names.

    Attributes:
        store_url: tiers, fastest first.
        tenant: the default tenant (requests with no ``cache_salt`` and no ``kvwarm_tenant``).
        config: the kvwarm configuration (precision, block size, TTL, loader, tenants).
        model_dir: the directory whose weights and tokenizer root the keys.
        write_back: whether computed prompt blocks are written to the store.
        plan: a plan file path, ``"latest"``, or ``None``.
        prefill_tokens_per_s: the configured prefill rate, or ``None`` (measured, else the default).
        load_mode: one of :data:`LOAD_MODES`.
    """

    store_url: str
    tenant: str
    config: KvwarmConfig
    model_dir: Path
    write_back: bool = True
    plan: str | None = None
    prefill_tokens_per_s: float | None = None
    load_mode: str = "auto"

    @property
    def loads(self) -> bool:
        """Whether the connector loads at all (``load_mode`` is not ``off``)."""
        return self.load_mode != "off"

    def async_loads(self, async_scheduling: bool) -> bool:
        """Whether a request waits a step for its load (vLLM's ``load_kv_async``), under ``async_scheduling``."""
        return self.load_mode == "async" or (self.load_mode == "auto" and bool(async_scheduling))


def _bad(key: str, message: str) -> ConnectorConfigError:
    return ConnectorConfigError(f"kvwarm connector: {PREFIX}.{key}: {message}")


def parse_settings(extra: Mapping[str, Any] | None, *, served_model: str,
                   revision: str | None = None) -> ConnectorSettings:
    """Check ``extra`` (vLLM's ``kv_connector_extra_config``) and load the config it names.

    Args:
        extra: the extra config as vLLM hands it (``None`` or a mapping).
        served_model: what vLLM serves (``model_config.model``): the default ``model``.
        revision: vLLM's model revision (for a hub id).

    Raises:
        ConnectorConfigError: an unknown key, a bad value, a config file that does not load, a
            model that cannot be found or fingerprinted. The message names the key.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ConnectorConfigError(f"kvwarm connector: unknown {PREFIX} key(s) {unknown}; valid keys: {list(KEYS)}")
    config_path = extra.get("config")
    if config_path is not None and (not isinstance(config_path, str) or not config_path):
        raise _bad("config", f"must be the path of a kvwarm config file, got {config_path!r}")
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        where = "config" if config_path else "config (from $KVWARM_CONFIG)"
        raise _bad(where, str(exc)) from None

    store_url = extra.get("store", config.store.url)
    if not isinstance(store_url, str) or not store_url.strip():
        raise _bad("store", f"must be a store URL such as 'file:///var/cache/kvwarm', got {store_url!r}")
    for part in (p.strip() for p in store_url.split(",") if p.strip()):
        if not part.startswith(("file://", "s3://")):
            raise _bad("store", f"{part!r} has an unknown scheme; use file:// (and optionally ,s3://bucket/prefix)")

    tenant = extra.get("tenant", "public")
    try:
        check_tenant_name(tenant)
        config.tenant(tenant)  # its secret's variable must be set: fail now, not at the first request
    except ValueError as exc:  # ConfigError is one
        raise _bad("tenant", str(exc)) from None
    try:
        check_default_tenant(config, tenant)  # a request without a salt must not act as a salted tenant
        config.salt_map()  # every tenant's cache salts (variables, files) readable and strong: fail now
    except ConfigError as exc:
        raise ConnectorConfigError(f"kvwarm connector: {exc}") from None

    write_back = extra.get("write_back", True)
    if not isinstance(write_back, bool):
        raise _bad("write_back", f"must be true or false, got {write_back!r}")

    plan = extra.get("plan")
    if plan is not None:
        if not isinstance(plan, str) or not plan:
            raise _bad("plan", f"must be a plan file or {LATEST!r}, got {plan!r}")
        if plan != LATEST and not Path(plan).expanduser().is_file():
            raise _bad("plan", f"plan file {plan!r} does not exist; give a plan file or {LATEST!r}")

    rate = extra.get("prefill_tokens_per_s")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not math.isfinite(rate) or rate <= 0):
        raise _bad("prefill_tokens_per_s", f"must be a positive number of tokens per second, got {rate!r}")

    load_mode = extra.get("load_mode", "auto")
    if load_mode not in LOAD_MODES:
        raise _bad("load_mode", f"must be one of {list(LOAD_MODES)}, got {load_mode!r}")

    model = extra.get("model", served_model)
    if not isinstance(model, str) or not model:
        raise _bad("model", f"must be a model directory or hub id, got {model!r}")
    model_dir = resolve_model_dir(model, revision, key="model" if "model" in extra else "model (default: "
                                  "the model vLLM serves)")
    return ConnectorSettings(store_url=store_url, tenant=tenant, config=config, model_dir=model_dir,
                             write_back=write_back, plan=plan, prefill_tokens_per_s=None if rate is None
                             else float(rate), load_mode=load_mode)


def loads_layer_by_layer(extra: Mapping[str, Any] | None) -> bool:
    """Whether a connector started with ``extra`` (vLLM's ``kv_connector_extra_config``) may load KV layer by
    layer during a forward: unless ``load_mode`` is ``off`` (both ``sync`` and ``async`` loads wait per layer
    in the forward). A value :func:`parse_settings` refuses says ``True`` (the safe answer; the connector's
    start fails on it anyway). Pure: vLLM asks it before any connector is made."""
    return dict(extra or {}).get("load_mode", "auto") != "off"


def resolve_model_dir(model: str, revision: str | None = None, *, key: str = "model") -> Path:
    """The directory of ``model``: itself when it is one, else its snapshot in the local hub cache.

    Raises:
        ConnectorConfigError: neither (the message names ``key``).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types; all mean "not here"
        raise _bad(key, f"{model!r} is neither a model directory nor in the local Hugging Face cache "
                        f"({type(exc).__name__}); give the directory `prefill warm --model` used") from None


def model_identities(model_dir: str | os.PathLike[str]) -> tuple[ModelIdentity, ModelIdentity | None]:
    """The model's identity for plain prompts, and for chat-templated ones (``None`` without a template).

    The weights digest is cached under kvwarm's home (:mod:`store.identity.fingerprint`), so
    only an engine's first start on a model reads every weight byte.

    Raises:
        ConnectorConfigError: the directory cannot be fingerprinted (names ``model``).
    """
    try:
        plain = identity_from_dir(model_dir)
    except IdentityError as exc:
        raise _bad("model", str(exc)) from None
    try:
        chat = identity_from_dir(model_dir, chat=True)
    except IdentityError:
        chat = None  # no chat template: prompts can only have been stored plain
    return plain, chat


def check_block_sizes(kvwarm_block: int, engine_block: int) -> int:
    """How many engine blocks one kvwarm block spans.

    Raises:
        ConnectorConfigError: kvwarm's block size is not a multiple of the engine's.
    """
    if engine_block < 1 or kvwarm_block % engine_block:
        raise ConnectorConfigError(
            f"kvwarm connector: kvwarm's kv_cache.block_size ({kvwarm_block}) must be a multiple of vLLM's "
            f"block size ({engine_block}); start vLLM with --block-size dividing {kvwarm_block} (the CPU backend "
            f"takes multiples of 32, e.g. 128; CUDA 16), or set kv_cache.block_size in the kvwarm config")
    return kvwarm_block // engine_block
