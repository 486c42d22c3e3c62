"""Attacks through a damaged namespace owner record (``meta/tenants/<ns>.json``; issue 31, point 4)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefill.cli import main
from store.errors import StoreRecordInvalid
from store.identity.tenant import Tenant
from store.miss import MissReason
from store.serving.loader import KVLoader
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.pool_workers import TINY, config, prompt, synthetic_prefix

ACME = Tenant.derive("acme", "acme-secret-of-at-least-32-characters")
BS = 16

DAMAGED = {
    "garbage": b"\xff\xfe\x00garbage\x80",
    "empty": b"",
    "list": b'["acme", "0123"]',
    "no_salt_id": b'{"namespace": "acme"}',
    "salt_id_number": b'{"namespace": "acme", "salt_id": 12}',
    "huge": b'{"namespace": "acme", "salt_id": "' + b"a" * (1 << 20) + b'"}',
}


def seeded(tmp_path: Path) -> tuple[list[int], object]:
    cfg = config(BS, "fp8")
    ids = prompt(3 * BS + 5, seed=41)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    assert synthetic_prefix(store, cfg, ids[: 2 * BS], layers=2, heads=2, head_dim=16, tenant=ACME) == 2
    store.close()
    return ids, cfg


def record(tmp_path: Path) -> Path:
    return tmp_path / "nvme" / "meta" / "tenants" / "acme.json"


def loader(tmp_path: Path, cfg, tenant: Tenant = ACME) -> KVLoader:
    return KVLoader(f"file://{tmp_path}/nvme", tenant=tenant, config=cfg, pool_bytes=1 << 30, model=TINY,
                    pool_dir=tmp_path / "pool")


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_attack_damaged_owner_record_makes_lookup_raise_is_a_counted_bad_record_miss(tmp_path, damage) -> None:
    ids, cfg = seeded(tmp_path)
    assert record(tmp_path).is_file()
    record(tmp_path).write_bytes(DAMAGED[damage])

    ld = loader(tmp_path, cfg)
    try:
        hit, reason = ld.lookup_with_reason(ids)
        assert hit is None and reason is MissReason.BAD_RECORD
        assert ld.store.stats["bad_record"] >= 1
        # writes there are refused, and the damaged record is never claimed again
        store = Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)])
        with pytest.raises(StoreRecordInvalid, match="owner record of namespace 'acme'"):
            synthetic_prefix(store, cfg, ids[: 3 * BS], layers=2, heads=2, head_dim=16, tenant=ACME)
        assert record(tmp_path).read_bytes() == DAMAGED[damage]
    finally:
        ld.close()


def test_attack_owner_record_with_salt_id_null_turns_the_owner_check_off_is_refused(tmp_path, capsys) -> None:
    ids, cfg = seeded(tmp_path)
    rec = record(tmp_path)
    rec.write_text(json.dumps({"namespace": "acme", "salt_id": None}))
    impostor = Tenant.derive("acme", "not-acme-secret-but-at-least-32-chars")  # the name without the secret

    ld = loader(tmp_path, cfg, impostor)
    try:
        hit, reason = ld.lookup_with_reason(ids)
        assert hit is None and reason is MissReason.BAD_RECORD
    finally:
        ld.close()
    store = Store([LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)])
    with pytest.raises(StoreRecordInvalid):
        store.list(impostor)
    with pytest.raises(StoreRecordInvalid):  # the impostor cannot claim the namespace either
        synthetic_prefix(store, cfg, ids[: BS], layers=2, heads=2, head_dim=16, tenant=impostor)
    assert json.loads(rec.read_text()) == {"namespace": "acme", "salt_id": None}

    code = main(["store", "--store", f"file://{tmp_path}/nvme", "verify", "--no-quarantine"])
    out = capsys.readouterr().out
    assert code == 1 and "BAD OWNER RECORD" in out and "acme.json" in out and "salt_id None" in out
