"""Whose request is it: a request's kvwarm tenant, from its vLLM ``cache_salt`` and ``kv_transfer_params``.

One engine serves many tenants; the connector's ``tenant`` setting is only the default. The rules:

1. A request with a ``cache_salt`` is the tenant whose ``tenants.<name>.cache_salts`` lists it. A
   salt the config does not map gets nothing from kvwarm (``tenant_unknown``): vLLM keeps salted
   requests apart in its own cache, and kvwarm must not join them to anyone's prefixes.
2. ``kv_transfer_params["kvwarm_tenant"]`` names a tenant the config knows (or the default, or
   ``public``); another name gets nothing (``tenant_unknown``). With a salt as well, both must
   name the same tenant, or the request gets nothing (``tenant_refused``).
3. Otherwise the request is the default tenant's.

Both fields come from the client through the serving stack, so a deployment where clients are
not trusted sets them at its gateway (as it must for vLLM's own ``cache_salt`` isolation).
Pure: no vLLM, no store access.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

from store.config import KvwarmConfig
from store.identity.tenant import PUBLIC, Tenant

#: The ``kv_transfer_params`` key a request names its tenant with.
TENANT_PARAM = "kvwarm_tenant"


@dataclass(frozen=True)
class RequestTenant:
    """The outcome for one request.

    Attributes:
        name: the tenant, or ``None`` when kvwarm serves the request nothing.
        refusal: why not (``tenant_unknown`` or ``tenant_refused``), else ``None``.
        detail: what was asked, for the log.
    """

    name: str | None
    refusal: str | None = None
    detail: str = ""


class TenantBook:
    """The tenants one engine serves: the salt map, the names it accepts, their credentials.

    Args:
        config: the kvwarm config (``tenants``: secrets and cache salts).
        default: the tenant of requests that name none.
    """

    def __init__(self, config: KvwarmConfig, default: str) -> None:
        self.config = config
        self.default = default
        self._by_salt = {salt: name for name, tc in config.tenants.items() for salt in tc.cache_salts}
        self.known = frozenset(config.tenants) | {default, PUBLIC}
        self._lock = threading.Lock()
        self._credentials: dict[str, Tenant] = {}

    def resolve(self, cache_salt: str | None, kv_transfer_params: Mapping[str, Any] | None) -> RequestTenant:
        """The tenant of a request with this ``cache_salt`` and these ``kv_transfer_params``."""
        claimed = kv_transfer_params.get(TENANT_PARAM) if isinstance(kv_transfer_params, Mapping) else None
        if claimed is not None and (not isinstance(claimed, str) or claimed not in self.known):
            return RequestTenant(None, "tenant_unknown", f"{TENANT_PARAM}={claimed!r} is not a configured tenant")
        if cache_salt:
            by_salt = self._by_salt.get(cache_salt)
            if by_salt is None:
                return RequestTenant(None, "tenant_unknown", "a cache_salt that no tenants.<name>.cache_salts lists")
            if claimed is not None and claimed != by_salt:
                return RequestTenant(None, "tenant_refused",
                                     f"{TENANT_PARAM}={claimed!r} but the cache_salt is tenant {by_salt!r}'s")
            return RequestTenant(by_salt)
        return RequestTenant(claimed if claimed is not None else self.default)

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
