"""Whose request is it: a request's kvwarm tenant, from its vLLM ``cache_salt`` and ``kv_transfer_params``.

One engine serves many tenants; the connector's ``tenant`` setting is only the default. A request
selects a tenant only through a secret it holds, its ``cache_salt``. The rules:

1. A request with a ``cache_salt`` is the tenant whose ``tenants.<name>.cache_salts`` lists it. A
   salt the config does not map gets nothing from kvwarm (``tenant_unknown``): vLLM keeps salted
   requests apart in its own cache, and kvwarm must not join them to anyone's prefixes. A
   ``kv_transfer_params["kvwarm_tenant"]`` beside it must name the same tenant, or the request
   gets nothing (``tenant_refused``).
2. ``kvwarm_tenant`` without a salt (a name is not a secret) gets nothing (``tenant_unverified``),
   unless the config trusts the gateway (``tenants.trust_named``): then it must name a tenant the
   config knows (or the default, or ``public``), else nothing (``tenant_unknown``).
3. Otherwise (no ``cache_salt``, or an empty one) the request is the default tenant's. The
   default never lists cache salts (:func:`check_default_tenant` refuses that config at start-up):
   a request without a salt must not act as a tenant that is selected by one, so it gets the
   default tenant's KV (``public`` unless the connector's ``tenant`` says otherwise), never a salted
   tenant's.

These reasons are the server's (counters, log). A client sees ``absent`` for all of them
(:func:`client_reason`), as for a tenant that has nothing stored: what it receives must not say
whether a name it tried is configured, or whether another tenant holds its prefix.
Pure: no vLLM, no store access.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

from store.config import KvwarmConfig
from store.errors import ConfigError
from store.identity.tenant import PUBLIC, Tenant
from store.tenant_secrets import salt_keys

#: The ``kv_transfer_params`` key a request names its tenant with.
TENANT_PARAM = "kvwarm_tenant"
#: Reasons that say something about the config or other tenants: a client sees ``absent`` instead.
TENANCY_REASONS = frozenset({"tenant_unknown", "tenant_refused", "tenant_unverified"})


def client_reason(reason: str | None) -> str | None:
    """The miss reason a client is told: ``absent`` for any of :data:`TENANCY_REASONS`."""
    return "absent" if reason in TENANCY_REASONS else reason


def _shown(claimed: Any) -> str:
    """A client's claim, for the log: quoted, cut short (it is whatever the client sent)."""
    text = repr(claimed)
    return text if len(text) <= 80 else text[:77] + "..."


def check_default_tenant(config: KvwarmConfig, default: str) -> None:
    """Refuse a default tenant (the connector's ``tenant``) that lists cache salts.

    Requests without a ``cache_salt`` are the default tenant's; if that tenant were also selected by
    its salts, a request could act as it without holding one.

    Raises:
        ConfigError: naming ``kv_connector_extra_config.tenant`` and the tenant's salt keys.
    """
    keys = salt_keys(default, config.tenants[default]) if default in config.tenants else []
    if keys:
        raise ConfigError(
            f"kv_connector_extra_config.tenant = {default!r} is the tenant of every request without a cache_salt, "
            f"but {' and '.join(keys)} make it a tenant selected by its salts: a request with no salt would act as "
            f"{default!r}. Set kv_connector_extra_config.tenant to 'public' (or a tenant without cache salts), or "
            f"remove {', '.join(keys)} (its requests are then all those without a salt)")


@dataclass(frozen=True)
class RequestTenant:
    """The outcome for one request.

    Attributes:
        name: the tenant, or ``None`` when kvwarm serves the request nothing.
        refusal: why not (``tenant_unknown``, ``tenant_refused``, ``tenant_unverified``), else ``None``.
        detail: what was asked, for the server's log (never shown to the client).
    """

    name: str | None
    refusal: str | None = None
    detail: str = ""


class TenantBook:
    """The tenants one engine serves: the salt map, the names it accepts, their credentials.

    Args:
        config: the kvwarm config (``tenants``: secrets and cache salts; ``tenants.trust_named``).
        default: the tenant of requests that name none; it must list no cache salts.
        environ: where ``cache_salts_env`` variables are read (default ``os.environ``).

    Raises:
        ConfigError: the default tenant lists cache salts (:func:`check_default_tenant`), or a
            tenant's salts cannot be read or are refused (:meth:`KvwarmConfig.salt_map`).
    """

    def __init__(self, config: KvwarmConfig, default: str, environ: Mapping[str, str] | None = None) -> None:
        check_default_tenant(config, default)
        self.config = config
        self.default = default
        self.trust_named = config.trust_named
        self._by_salt = config.salt_map(environ)
        self.known = frozenset(config.tenants) | {default, PUBLIC}
        self._lock = threading.Lock()
        self._credentials: dict[str, Tenant] = {}
        # A secret tenant's salt costs an scrypt (~50 ms): paid here, at start-up, not on vLLM's
        # scheduler thread at the tenant's first request. A tenant whose variable is unset is left to
        # :meth:`credentials`, which raises when (if ever) a request needs it, as before.
        for name in sorted(self.known):
            try:
                self.credentials(name)
            except ConfigError:
                pass

    def resolve(self, cache_salt: str | None, kv_transfer_params: Mapping[str, Any] | None) -> RequestTenant:
        """The tenant of a request with this ``cache_salt`` and these ``kv_transfer_params``."""
        claimed = kv_transfer_params.get(TENANT_PARAM) if isinstance(kv_transfer_params, Mapping) else None
        if cache_salt:
            by_salt = self._by_salt.get(cache_salt)
            if by_salt is None:
                return RequestTenant(None, "tenant_unknown", "a cache_salt that no tenants.<name>.cache_salts lists")
            if claimed is not None and claimed != by_salt:
                return RequestTenant(None, "tenant_refused",
                                     f"{TENANT_PARAM}={_shown(claimed)} but the cache_salt is tenant {by_salt!r}'s")
            return RequestTenant(by_salt)
        if claimed is None:
            return RequestTenant(self.default)
        if not self.trust_named:
            return RequestTenant(None, "tenant_unverified", f"{TENANT_PARAM}={_shown(claimed)} without a cache_salt of "
                                 "that tenant; a name is honoured only with tenants.trust_named")
        if not isinstance(claimed, str) or claimed not in self.known:
            return RequestTenant(None, "tenant_unknown", f"{TENANT_PARAM}={_shown(claimed)} is not a configured tenant")
        return RequestTenant(claimed)

    def credentials(self, name: str) -> Tenant:
        """The tenant's name and salt (its secret read from the environment once).

        Raises:
            store.errors.ConfigError: the tenant's secret variable is not set.
        """
        with self._lock:
            tenant = self._credentials.get(name)
        if tenant is None:
            tenant = self.config.tenant(name)
            with self._lock:
                self._credentials[name] = tenant
        return tenant

    def others(self, name: str) -> list[str]:
        """Every tenant this engine serves other than ``name`` and ``public`` (cross-tenant checks)."""
        return sorted(self.known - {name, PUBLIC})
