"""A request's tenant: cache_salt through the config, kvwarm_tenant only when trusted, the default (never a
salted tenant); refusals named."""
from __future__ import annotations

import pytest

from store.config import parse_config
from store.engines.vllm.tenancy import TENANCY_REASONS, RequestTenant, TenantBook, client_reason
from store.errors import ConfigError

SALT_A, SALT_A2, SALT_B = "salt-a-0123456789abcdef", "salt-a2-0123456789abcdef", "salt-b-0123456789abcdef"
TENANTS = {"acme": {"cache_salts": [SALT_A, SALT_A2]},
           "bolt": {"cache_salts": [SALT_B], "secret_env": "BOLT_SECRET_FOR_TEST"}}


@pytest.fixture()
def book() -> TenantBook:
    return TenantBook(parse_config({"tenants": TENANTS}), "public")


@pytest.fixture()
def trusting() -> TenantBook:
    return TenantBook(parse_config({"tenants": {**TENANTS, "trust_named": True}}), "public")


def test_the_default_tenant_serves_requests_that_name_none_and_is_never_a_salted_one(book: TenantBook) -> None:
    assert book.resolve(None, None) == RequestTenant("public")
    assert book.resolve("", {"other_connector": 1}) == RequestTenant("public")
    desk = TenantBook(parse_config({"tenants": {**TENANTS, "desk": {}}}), "desk")  # a tenant without salts
    assert desk.resolve(None, None) == desk.resolve("", None) == RequestTenant("desk")
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.tenant = 'acme'.*tenants\.acme\.cache_salts"):
        TenantBook(parse_config({"tenants": TENANTS}), "acme")


def test_cache_salts_map_to_their_tenant(book: TenantBook) -> None:
    assert book.resolve(SALT_B, None).name == "bolt"
    assert book.resolve(SALT_A2, None).name == "acme"
    assert book.resolve(SALT_B, {"kvwarm_tenant": "bolt"}).name == "bolt"  # a name with its salt


@pytest.mark.parametrize("name", ["bolt", "acme", "public", "mallory", 7])
def test_a_name_without_its_salt_selects_nothing_unless_the_gateway_is_trusted(book, trusting, name) -> None:
    got = book.resolve(None, {"kvwarm_tenant": name})
    assert got.name is None and got.refusal == "tenant_unverified" and got.detail
    if name in ("bolt", "acme", "public"):
        assert trusting.resolve(None, {"kvwarm_tenant": name}).name == name
    else:
        assert trusting.resolve(None, {"kvwarm_tenant": name}).refusal == "tenant_unknown"


@pytest.mark.parametrize("salt, params, refusal", [
    ("salt-unmapped", None, "tenant_unknown"),
    (SALT_A, {"kvwarm_tenant": "bolt"}, "tenant_refused"),
    (SALT_A, {"kvwarm_tenant": "mallory"}, "tenant_refused"),
])
def test_requests_kvwarm_must_not_serve_get_nothing_and_say_why(book, trusting, salt, params, refusal) -> None:
    for b in (book, trusting):
        got = b.resolve(salt, params)
        assert got.name is None and got.refusal == refusal and got.detail


def test_a_client_is_told_absent_for_every_tenancy_reason() -> None:
    assert TENANCY_REASONS == {"tenant_unknown", "tenant_refused", "tenant_unverified"}
    assert {client_reason(r) for r in TENANCY_REASONS} == {"absent"}
    assert [client_reason(r) for r in ("corrupt", "short_prompt", None)] == ["corrupt", "short_prompt", None]


def test_a_claim_is_logged_cut_short(book) -> None:
    assert len(book.resolve(None, {"kvwarm_tenant": "x" * 10_000}).detail) < 200


def test_credentials_are_read_once_and_need_their_secret(book: TenantBook, monkeypatch) -> None:
    monkeypatch.delenv("BOLT_SECRET_FOR_TEST", raising=False)
    with pytest.raises(ConfigError, match="BOLT_SECRET_FOR_TEST"):
        book.credentials("bolt")
    monkeypatch.setenv("BOLT_SECRET_FOR_TEST", "s3cret-0123456789")
    first = book.credentials("bolt")
    monkeypatch.setenv("BOLT_SECRET_FOR_TEST", "changed-0123456789")
    assert book.credentials("bolt") is first
    assert book.credentials("acme").salt != first.salt
    assert book.others("acme") == ["bolt"] and book.others("public") == ["acme", "bolt"]
