"""``prefill store ...`` end to end, through the installed console script's main()."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefill.cli import main
from store.config import parse_config
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.store.factories import make_chain, make_root, make_snapshot


@pytest.fixture()
def populated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, list]:
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text("tenants:\n  acme:\n    secret_env: ACME_SECRET\n")
    monkeypatch.setenv("ACME_SECRET", "acme-secret-0123456789")
    acme = parse_config({"tenants": {"acme": {"secret_env": "ACME_SECRET"}}}).tenant("acme")
    url = f"file://{tmp_path / 'nvme'}"
    store = Store([LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)])
    root = make_root(acme)
    chain = make_chain(root, 3)
    for b in chain:
        store.put(acme, make_snapshot(root, b, tenant=acme))
    store.close()
    return url, cfg, chain


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ls_stat_rm(populated, capsys) -> None:
    url, cfg, chain = populated
    code, out, _ = run(capsys, "store", "--config", str(cfg), "--store", url, "ls", "--tenant", "acme", "--long")
    assert code == 0 and "3 snapshot(s)" in out and chain[0].key in out and "tokens=16" in out
    code, out, _ = run(capsys, "store", "--config", str(cfg), "--store", url, "stat", chain[1].key, "--tenant", "acme")
    info = json.loads(out)
    assert code == 0 and info["parent_key"] == chain[0].key and info["tiers"] == ["nvme"] and not info["expired"]
    code, out, _ = run(capsys, "store", "--config", str(cfg), "--store", url, "rm", chain[1].key, "--tenant", "acme")
    assert code == 0 and "removed from 1 tier" in out
    code, _, err = run(capsys, "store", "--config", str(cfg), "--store", url, "stat", chain[1].key, "--tenant", "acme")
    assert code == 1 and "no snapshot" in err


def test_verify_exits_nonzero_and_lists_corrupt(populated, capsys) -> None:
    url, cfg, chain = populated
    code, out, _ = run(capsys, "store", "--config", str(cfg), "--store", url, "verify")
    assert code == 0 and "3 ok, 0 bad" in out
    victim = next(Path(url[7:]).glob(f"objects/acme/*/{chain[2].key}.kvw"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, _ = run(capsys, "store", "--config", str(cfg), "--store", url, "verify")
    assert code == 1 and "CORRUPT" in out and chain[2].key in out and "quarantined ->" in out
    code, out, _ = run(capsys, "store", "--config", str(cfg), "--store", url, "verify")
    assert code == 0 and "2 ok, 0 bad" in out  # the bad one is in quarantine now, not deleted
    assert list(Path(url[7:]).glob("quarantine/*.kvw"))


def test_gc_reports_json(populated, capsys) -> None:
    url, cfg, _ = populated
    code, out, _ = run(capsys, "store", "--config", str(cfg), "--store", url, "gc", "--verify")
    report = json.loads(out)
    assert code == 0 and report["expired_removed"] == 0 and report["verify"]["checked"] == 3


def test_errors_are_clear(populated, capsys, tmp_path: Path) -> None:
    url, cfg, _ = populated
    code, _, err = run(capsys, "store", "--config", str(cfg), "--store", url, "stat", "nothex", "--tenant", "acme")
    assert code == 2 and "not a block key" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache:\n  compression: fp4\n")
    code, _, err = run(capsys, "store", "--config", str(bad), "ls", "--tenant", "acme")
    assert code == 2 and "kv_cache.compression" in err
    code, _, err = run(capsys, "store", "--config", str(cfg), "--store", url, "ls", "--tenant", "acme",
                       "--namespace", "bolt")
    assert code == 1 and "TenantAccessDenied" in err


def test_store_and_config_go_before_or_after_the_command_and_the_later_wins(populated, capsys) -> None:
    url, cfg, chain = populated
    for argv in (["store", "ls", "--store", url, "--tenant", "acme", "--config", str(cfg)],
                 ["store", "--config", str(cfg), "ls", "--tenant", "acme", "--store", url],
                 ["--store", url, "--config", str(cfg), "store", "ls", "--tenant", "acme"]):
        code, out, err = run(capsys, *argv)
        assert code == 0 and "3 snapshot(s)" in out, (argv, err)
    code, out, _ = run(capsys, "--store", "typo://x", "store", "--store", "typo://y", "ls", "--store", url,
                       "--config", str(cfg), "--tenant", "acme")
    assert code == 0 and "3 snapshot(s)" in out
    code, _, err = run(capsys, "store", "--store", url, "ls", "--store", "typo://y", "--tenant", "acme")
    assert code == 2 and err.startswith("prefill: error: ") and "'typo://y' has an unknown scheme" in err


def test_every_command_that_reads_a_store_shows_both_options_in_its_help(capsys) -> None:
    stores = [["store", c] for c in ("ls", "stat", "verify", "gc", "rm", "audit")]
    for command in (["warm"], ["report"], ["demo"], *stores):
        with pytest.raises(SystemExit) as done:
            main([*command, "-h"])
        text = capsys.readouterr().out
        assert done.value.code == 0 and "--store URL" in text and "--config FILE" in text, command
    with pytest.raises(SystemExit) as done:  # simulate reads neither: refused, not ignored
        main(["--store", "file:///tmp/x", "simulate", "--trace", "t.jsonl", "--policy", "vllm"])
    assert done.value.code == 2 and "prefill simulate takes no --config or --store" in capsys.readouterr().err
