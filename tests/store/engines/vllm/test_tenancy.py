"""A request's tenant: cache_salt through the config, kvwarm_tenant, the default; refusals named."""
from __future__ import annotations

import pytest

from store.config import parse_config
from store.engines.vllm.tenancy import RequestTenant, TenantBook
from store.errors import ConfigError


@pytest.fixture()
def book() -> TenantBook:
    cfg = parse_config({"tenants": {"acme": {"cache_salts": ["salt-a", "salt-a2"]},
                                    "bolt": {"cache_salts": ["salt-b"], "secret_env": "BOLT_SECRET_FOR_TEST"}}})
    return TenantBook(cfg, "acme")


def test_the_default_tenant_serves_requests_that_name_none(book: TenantBook) -> None:
    assert book.resolve(None, None) == RequestTenant("acme")
    assert book.resolve("", {"other_connector": 1}) == RequestTenant("acme")


def test_cache_salts_map_to_their_tenant(book: TenantBook) -> None:
    assert book.resolve("salt-b", None).name == "bolt"
    assert book.resolve("salt-a2", None).name == "acme"


def test_kv_transfer_params_name_a_known_tenant(book: TenantBook) -> None:
    assert book.resolve(None, {"kvwarm_tenant": "bolt"}).name == "bolt"
    assert book.resolve(None, {"kvwarm_tenant": "public"}).name == "public"
    assert book.resolve("salt-b", {"kvwarm_tenant": "bolt"}).name == "bolt"


@pytest.mark.parametrize("salt, params, refusal", [
    ("salt-unmapped", None, "tenant_unknown"),
    (None, {"kvwarm_tenant": "mallory"}, "tenant_unknown"),
    (None, {"kvwarm_tenant": 7}, "tenant_unknown"),
    ("salt-a", {"kvwarm_tenant": "bolt"}, "tenant_refused"),
])
def test_requests_kvwarm_must_not_serve_get_nothing_and_say_why(book, salt, params, refusal) -> None:
    got = book.resolve(salt, params)
    assert got.name is None and got.refusal == refusal and got.detail


def test_credentials_are_read_once_and_need_their_secret(book: TenantBook, monkeypatch) -> None:
    monkeypatch.delenv("BOLT_SECRET_FOR_TEST", raising=False)
    with pytest.raises(ConfigError, match="BOLT_SECRET_FOR_TEST"):
        book.credentials("bolt")
    monkeypatch.setenv("BOLT_SECRET_FOR_TEST", "s3cret")
    first = book.credentials("bolt")
    monkeypatch.setenv("BOLT_SECRET_FOR_TEST", "changed")
    assert book.credentials("bolt") is first
    assert book.credentials("acme").salt != first.salt
    assert book.others("acme") == ["bolt"] and book.others("public") == ["acme", "bolt"]
