"""The one configuration file of kvwarm, validated with pydantic.

Operators coming from the SageMaker KV-reuse write-up find its keys under
``kv_cache`` (``reuse_strategy``, ``similarity_threshold``, ``max_shared_instances``,
``compression``). Files may be YAML, JSON or TOML; ``docs/reference/config.md`` documents
every key (generated from the fields' descriptions by ``docs/generate.py``). A bad value raises :class:`store.errors.ConfigError` naming the key, the value
and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import tomllib
import yaml
from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from store.config_sections import (
    AgentConfig,
    FleetMemoryConfig,
    KvCacheConfig,
    LoaderConfig,
    MonitoringConfig,
    NodeConfig,
    S3Config,
    StoreConfig,
    TenantConfig,
    _Section,
)
from store.errors import ConfigError
from store.identity.tenant import PUBLIC, Tenant, check_tenant_name
from store.tenant_secrets import SALT_KEYS, check_strength, salt_keys, salt_map, tenant_cache_salts

__all__ = ["AgentConfig", "CONFIG_ENV", "FleetMemoryConfig", "KvCacheConfig", "KvwarmConfig", "LoaderConfig",
           "MonitoringConfig", "NodeConfig", "S3Config", "StoreConfig",
           "TenantConfig", "load_config", "parse_config", "with_values"]

#: environment variable naming the config file when none is passed
CONFIG_ENV = "KVWARM_CONFIG"
#: the one key under ``tenants`` that is a setting, not a tenant (no tenant may be configured by that name)
TRUST_NAMED = "trust_named"


class KvwarmConfig(_Section):
    """The whole system's configuration."""

    kv_cache: KvCacheConfig = Field(KvCacheConfig(), description="What is cached and how.")
    store: StoreConfig = Field(StoreConfig(), description="Where snapshots live.")
    loader: LoaderConfig = Field(LoaderConfig(), description="Serving-side loader defaults.")
    fleet_memory: FleetMemoryConfig = Field(
        FleetMemoryConfig(), description="What serving nodes record of the blocks they serve, for nodes that start "
        "later (docs/reference/fleet.md).")
    agent: AgentConfig = Field(AgentConfig(), description="The serving node's agent: the plan and the fleet's memory.")
    node: NodeConfig = Field(NodeConfig(), description="The kvwarm node process: its socket, metrics and GC.")
    monitoring: MonitoringConfig = Field(MonitoringConfig(), description="Prices for the reports' economics.")
    tenants: dict[str, TenantConfig] = Field(
        {}, description="One entry per tenant name (1-63 characters of a-z 0-9 _ . -); 'public' is the shared "
        "namespace and has no secret. 'trust_named' is reserved: tenants.trust_named is a setting, not a tenant.")
    # In the file this is tenants.trust_named (moved here on the way in, back on the way out): a boolean
    # under ``tenants`` cannot be mistaken for a tenant's mapping, and no tenant may take the name.
    trust_named: bool = Field(
        False, json_schema_extra={"section": "tenants"},
        description="Honour a tenant name a vLLM request gives in kv_transfer_params (kvwarm_tenant) without "
        "that tenant's cache_salt. Only for a gateway that sets the field itself: a name is not a secret, and "
        "with this off a request selects a tenant only through a cache_salt listed in tenants.<name>.cache_salts "
        "(a bare name loads nothing).")

    @model_validator(mode="before")
    @classmethod
    def _tenants_setting(cls, data: Any) -> Any:
        """``tenants.trust_named`` (the file's spelling) into the ``trust_named`` field."""
        if not isinstance(data, dict):
            return data
        if TRUST_NAMED in data:
            raise ValueError(f"{TRUST_NAMED} is a key of the tenants section: write it as tenants.{TRUST_NAMED}")
        tenants = data.get("tenants")
        if not isinstance(tenants, dict) or TRUST_NAMED not in tenants:
            return data
        tenants = dict(tenants)
        value = tenants.pop(TRUST_NAMED)
        if not isinstance(value, bool):
            raise ValueError(f"tenants.{TRUST_NAMED} = {value!r}: it is the setting 'honour tenant names without "
                             f"their cache_salt', true or false, not a tenant ('{TRUST_NAMED}' is reserved: give "
                             "that tenant another name)")
        return {**data, "tenants": tenants, TRUST_NAMED: value}

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The file's shape: ``trust_named`` back under ``tenants`` (when on), so a dump parses again."""
        out = handler(self)
        if isinstance(out, dict) and out.pop(TRUST_NAMED, False):
            out["tenants"] = {TRUST_NAMED: True, **out.get("tenants", {})}
        return out

    @model_validator(mode="after")
    def _check_tenants(self) -> "KvwarmConfig":
        # the salts written in the file are checked here (pure); those of variables and files where
        # they are read (cache_salts), with the same rules. Messages never show a salt: it is a secret.
        owner: dict[str, str] = {}
        for name, tc in self.tenants.items():
            check_tenant_name(name)
            if name == PUBLIC and tc.secret_env:
                raise ValueError("tenants.public cannot have a secret_env: the public salt is well known")
            if name != PUBLIC and tc.writer_secret_env:
                raise ValueError(f"tenants.{name}.writer_secret_env: only tenants.public has a writer credential "
                                 "(tenants write and delete only in their own namespace)")
            if name == PUBLIC and salt_keys(name, tc):
                raise ValueError(f"tenants.public cannot have {' or '.join(SALT_KEYS)}: requests are a tenant's "
                                 "own, and public prefixes serve every tenant already")
            for i, salt in enumerate(tc.cache_salts):
                if not salt:
                    raise ValueError(f"tenants.{name}.cache_salts: a cache_salt must not be empty")
                try:
                    check_strength(salt, f"tenants.{name}.cache_salts", f"cache_salt #{i + 1}")
                except ConfigError as exc:
                    raise ValueError(str(exc)) from None
                if owner.setdefault(salt, name) != name:
                    raise ValueError(f"tenants.{name}.cache_salts: cache_salt #{i + 1} is already tenant "
                                     f"{owner[salt]!r}'s; a cache_salt names one tenant")
        return self

    def cache_salts(self, name: str, environ: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
        """Tenant ``name``'s vLLM ``cache_salt`` values: ``cache_salts``, ``$cache_salts_env``'s and
        ``cache_salts_file``'s, merged (read now; see :mod:`store.tenant_secrets`).

        Raises:
            ConfigError: a named variable or file is missing or lists none, or a salt is too short.
        """
        return tenant_cache_salts(name, self.tenants.get(name, TenantConfig()), os.environ if environ is None
                                  else environ)

    def salt_map(self, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """Every tenant's ``cache_salt`` values (all sources, read now), each mapped to its one tenant.

        Raises:
            ConfigError: as :meth:`cache_salts`, or a salt two tenants list.
        """
        return salt_map(self.tenants, os.environ if environ is None else environ)

    def tenant(self, name: str, environ: Optional[dict[str, str]] = None) -> Tenant:
        """Credentials for ``name`` from the environment variables the config names (for ``public``, the
        writer credential of ``tenants.public.writer_secret_env`` when that variable is set).

        Raises:
            ConfigError: a named variable is unset, the secret is shorter than 16 characters
                (:data:`store.tenant_secrets.MIN_SECRET_CHARS`), or the encryption key is malformed.
        """
        env = os.environ if environ is None else environ
        tc = self.tenants.get(name, TenantConfig())
        secret = None
        if tc.secret_env:
            secret = check_strength(_env(env, tc.secret_env, f"tenants.{name}.secret_env"),
                                    f"tenants.{name}.secret_env", f"the value of ${tc.secret_env}")
        key = None
        if tc.encryption_key_env:
            raw = _env(env, tc.encryption_key_env, f"tenants.{name}.encryption_key_env")
            try:
                key = bytes.fromhex(raw)
            except ValueError:
                key = b""
            if len(key) != 32:
                raise ConfigError(
                    f"tenants.{name}.encryption_key_env: ${tc.encryption_key_env} must hold 64 hex characters (32 bytes)"
                )
        tenant = Tenant.derive(name, secret, key)
        # the public writer's credential: a process without the variable (a serving node) only reads public KV
        writer = env.get(tc.writer_secret_env) if name == PUBLIC and tc.writer_secret_env else None
        if writer:
            check_strength(writer, "tenants.public.writer_secret_env", f"the value of ${tc.writer_secret_env}")
        return dataclasses.replace(tenant, writer_key=writer.encode()) if writer else tenant


def _env(env: Any, var: str, key: str) -> str:
    value = env.get(var)
    if not value:
        raise ConfigError(f"{key}: environment variable ${var} is not set; export it or remove the key")
    return value


#: pydantic's error types for a value of the wrong type, and what the key takes instead
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "bool_type": "a boolean (true or false)", "bool_parsing": "a boolean (true or false)",
    "string_type": "a string", "tuple_type": "a list", "list_type": "a list",
    "dict_type": "a mapping of keys", "model_type": "a mapping of keys", "model_attributes_type": "a mapping of keys",
    "byte_size": "a size: a whole number of bytes, or a string with a unit such as '64GiB' or '2GB'",
    "byte_size_unit": "a size: a whole number of bytes, or a string with a unit such as '64GiB' or '2GB'",
    "finite_number": "a finite number (inf and nan are not allowed here)",
}
_SIZE = ("byte_size", "byte_size_unit")
_SCALAR = ("int_type", "int_parsing", "float_type", "float_parsing", "bool_type", "bool_parsing")


def _kind(value: Any) -> str:
    """What a value from a file is, in the file's words."""
    if isinstance(value, bool):
        return "a boolean (true/false)"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "null" if value is None else type(value).__name__


def _message(err: Any) -> str:
    """One error's text: for a value of the wrong type, the type the key takes and the type it got."""
    kind, value = err["type"], err.get("input")
    if kind in _SIZE and isinstance(value, str):
        return f"{value!r} is not a size ({err['msg']}): expected {_EXPECTED[kind]}"
    if kind in _EXPECTED:
        hint = " (write it without quotes)" if isinstance(value, str) and kind in _SCALAR else ""
        return f"expected {_EXPECTED[kind]}, got {_kind(value)}{hint}"
    return str(err["msg"]).removeprefix("Value error, ")


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid kvwarm configuration ({source}):"]
    for err in exc.errors():
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".") or "(top level)"
        value = err.get("input")
        msg = _message(err)
        if err["type"] == "extra_forbidden":
            parent = _section_for(err["loc"][:-1])
            allowed = ", ".join(parent.model_fields) if parent else "see docs/reference/config.md"
            msg = f"unknown key; allowed keys here: {allowed}"
        shown = "{...}" if isinstance(value, dict) else repr(list(value)) if isinstance(value, tuple) else repr(value)
        lines.append(f"  {loc} = {shown}: {msg}")
    return "\n".join(lines)


def _section_for(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose keys are allowed at ``loc`` (for "allowed keys here" messages)."""
    if loc[:1] == ("tenants",):
        return TenantConfig if len(loc) == 2 else None
    model: type[BaseModel] = KvwarmConfig
    for part in loc:
        field = model.model_fields.get(part)
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def parse_config(data: dict[str, Any] | None, *, source: str = "<dict>") -> KvwarmConfig:
    """Validate a config mapping.

    Raises:
        ConfigError: with one line per bad key: ``key = value: what is allowed``.
    """
    try:
        return KvwarmConfig.model_validate(data or {})
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def with_values(config: KvwarmConfig, section: str, values: dict[str, Any], *, source: str) -> KvwarmConfig:
    """``config`` with ``values`` in place of keys of ``section`` (e.g. a CLI flag's
    ``{"block_size": 16}`` in ``kv_cache``), validated as a file's values are.

    Raises:
        ConfigError: a value is out of range; ``source`` (the flag) is named with the key.
    """
    data = config.model_dump()
    data[section] = {**data[section], **values}
    return parse_config(data, source=source)


def load_config(path: str | os.PathLike[str] | None = None) -> KvwarmConfig:
    """Load the config from ``path``, else ``$KVWARM_CONFIG``, else the defaults.

    YAML (``.yaml``/``.yml``), JSON (``.json``) and TOML (``.toml``) are accepted.

    Raises:
        ConfigError: the file is missing, unparsable, or has invalid values.
    """
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return KvwarmConfig()
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (from {'--config' if path else CONFIG_ENV})")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        elif p.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {str(p)!r}: unknown extension; use .yaml, .yml, .json or .toml")
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be parsed: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return parse_config(data, source=str(p))
