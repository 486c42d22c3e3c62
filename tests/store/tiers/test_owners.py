"""Owner records and the public writer: the strict parser, the credential a tier records, the config key."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from store.config import parse_config
from store.errors import ConfigError, StoreRecordInvalid, TenantAccessDenied
from store.identity.tenant import PUBLIC, PUBLIC_TENANT, Tenant
from store.tiers.local import LocalTier
from store.tiers.owners import MAX_RECORD_BYTES, OwnerRecord, parse_owner_record, writer_id
from store.tiers.store import Store
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

CREDENTIAL = b"the-operators-public-writer-credential"
WRITER = dataclasses.replace(PUBLIC_TENANT, writer_key=CREDENTIAL)
SID = ACME.salt_id


def test_a_record_round_trips_and_each_defect_is_named() -> None:
    rec = OwnerRecord(PUBLIC, PUBLIC_TENANT.salt_id, writer_id(CREDENTIAL))
    assert parse_owner_record(rec.to_bytes(), PUBLIC, "here") == rec
    assert parse_owner_record(OwnerRecord("acme", SID).to_bytes(), "acme", "here").writer_id is None
    bad = {
        json.dumps({"namespace": "beta", "salt_id": SID}): "names namespace 'beta'",
        json.dumps({"namespace": "acme", "salt_id": SID.upper()}): "has salt_id",
        json.dumps({"namespace": "acme", "salt_id": SID, "writer_id": "x"}): "has writer_id",
        json.dumps({"namespace": "acme", "salt_id": SID, "writer_id": SID}): "only the public namespace",
        json.dumps({"namespace": "acme", "salt_id": SID, "owner": "me"}): "unknown fields",
        "[" * 100_000: f"at most {MAX_RECORD_BYTES}",
        "[" * 3000 + "]" * 3000: f"at most {MAX_RECORD_BYTES}",
        "[" * 50 + "]" * 50: "holds a JSON list",
        "[" * 2000 + "]" * 2000: "nests too deep",
    }
    for raw, why in bad.items():
        with pytest.raises(StoreRecordInvalid, match=why) as err:
            parse_owner_record(raw.encode(), "acme", "file:///x meta/tenants/acme.json")
        assert err.value.location == "file:///x meta/tenants/acme.json"


def test_writer_id_is_slow_keyed_and_cached() -> None:
    assert writer_id(CREDENTIAL) == writer_id(CREDENTIAL) != writer_id(CREDENTIAL + b"!")
    assert len(writer_id(CREDENTIAL)) == 32 and CREDENTIAL.hex() not in writer_id(CREDENTIAL)


def public_put(store: Store, writer: Tenant, start: int = 0) -> None:
    root = make_root(PUBLIC_TENANT)
    for b in make_chain(root, 1, start=start):
        store.put(writer, make_snapshot(root, b, tenant=PUBLIC_TENANT))


def test_once_a_tier_records_the_writers_credential_only_its_holder_writes_or_deletes_public(tmp_path: Path) -> None:
    store = Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)])
    public_put(store, WRITER)
    record = json.loads((tmp_path / "nvme" / "meta" / "tenants" / "public.json").read_bytes())
    assert record["writer_id"] == writer_id(CREDENTIAL)

    fresh = Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)])  # a process whose config lacks the key
    wrong = dataclasses.replace(PUBLIC_TENANT, writer_key=b"a-guess-at-the-credential")
    for who in (PUBLIC_TENANT, wrong):
        with pytest.raises(TenantAccessDenied, match="records a writer credential"):
            public_put(fresh, who, start=100)
        with pytest.raises(TenantAccessDenied, match="records a writer credential"):
            fresh.delete(who, make_chain(make_root(PUBLIC_TENANT), 1)[0].key, PUBLIC)
    assert fresh.stats["refused"] == 4
    assert fresh.probe(ACME, make_chain(make_root(PUBLIC_TENANT), 1), make_root(PUBLIC_TENANT)).count == 1  # reads open
    public_put(fresh, WRITER, start=100)
    assert fresh.delete(WRITER, make_chain(make_root(PUBLIC_TENANT), 1)[0].key, PUBLIC) == 1


def test_without_a_credential_the_public_tenant_writes_and_a_later_credential_is_recorded(tmp_path: Path) -> None:
    store = Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)])
    public_put(store, PUBLIC_TENANT)  # the demo and single-tenant setups: no credential configured
    assert "writer_id" not in json.loads((tmp_path / "nvme" / "meta" / "tenants" / "public.json").read_bytes())
    public_put(store, WRITER, start=100)  # the operator sets one: the tier records it from now on
    assert json.loads((tmp_path / "nvme" / "meta" / "tenants" / "public.json").read_bytes())["writer_id"]
    with pytest.raises(TenantAccessDenied):
        public_put(Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)]), PUBLIC_TENANT, start=200)


def test_the_config_names_the_writers_variable_for_public_only() -> None:
    cfg = parse_config({"tenants": {"public": {"writer_secret_env": "KV_PUBLIC_WRITER"}}})
    assert cfg.tenant(PUBLIC, {"KV_PUBLIC_WRITER": "operator-credential-0123456789"}).writer_key == b"operator-credential-0123456789"
    assert cfg.tenant(PUBLIC, {}).writer_key is None  # a serving node: reads public KV, needs no credential
    assert "operator-credential-0123456789" not in repr(cfg.tenant(PUBLIC, {"KV_PUBLIC_WRITER": "operator-credential-0123456789"}))
    with pytest.raises(ConfigError, match="only tenants.public has a writer credential"):
        parse_config({"tenants": {"acme": {"writer_secret_env": "X"}}})
    with pytest.raises(ValueError, match="only 'public' has a writer credential"):
        Tenant("acme", ACME.salt, writer_key=b"x")
