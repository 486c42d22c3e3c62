"""``prefill store verify`` names every metadata file a reader would skip (issue 31, point 4: "prefill store
verify reports it"): a fleet record out of bounds and a published plan of the wrong types, beside the
snapshots it checks; a store with sound records verifies clean."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefill.cli import main
from store.published_plan import LATEST_PLAN
from store.tiers.local import LocalTier

T0 = 1_700_000_000.0


def fleet_record(**changes) -> bytes:
    doc = {"format": "kvwarm-fleet/1", "namespace": "acme", "node": "node-a", "written_at": T0, "traffic": 5,
           "window_s": 60.0, "keys": ["ab" * 32], "age_s": [1.5], "uses": [2], "traffic_age": [3]}
    doc.update(changes)
    return json.dumps(doc).encode()


def verify(capsys: pytest.CaptureFixture[str], url: str) -> tuple[int, str]:
    code = main(["store", "--store", url, "verify"])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name, data, says", [
    ("fleet/acme/node-a.json", fleet_record(uses=[10 ** 12]), "uses"),
    ("fleet/acme/node-a.json", fleet_record(written_at=1e300), "written_at"),
    ("fleet/acme/node-a.json", b"\xff\xfe not json", "fleet/acme/node-a.json"),
    (LATEST_PLAN, json.dumps({"kvwarm_published_plan": 1, "created_at": "yesterday", "entries": []}).encode(), "created_at"),
    (LATEST_PLAN, b"[1, 2", "latest plan"),
])
def test_attack_a_bad_fleet_record_or_published_plan_passes_verify_is_reported(tmp_path: Path, capsys, name: str,
                                                                               data: bytes, says: str) -> None:
    tier = LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)
    tier.put_meta(name, data)
    tier.close()
    code, out = verify(capsys, f"file://{tmp_path / 'nvme'}")
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith("BAD RECORD")]
    assert len(lines) == 1 and says in lines[0], out


def test_sound_records_verify_clean(tmp_path: Path, capsys) -> None:
    import time

    tier = LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)
    tier.put_meta("fleet/acme/node-a.json", fleet_record(written_at=time.time()))
    tier.close()
    code, out = verify(capsys, f"file://{tmp_path / 'nvme'}")
    assert code == 0 and "BAD RECORD" not in out, out
