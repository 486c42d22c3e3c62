"""``prefill store audit``: the table, --json, exit 1 when a copy differs (as verify), 2 for another model."""
from __future__ import annotations

import json

import pytest

from prefill.cli import main
from store.identity.fingerprint import ModelIdentity
from store.tiers.store import Store
from tests.prefill.audit_store import names, put_chain, tokens
from tests.prefill.factories import config_for

BLOCK = 16


@pytest.fixture()
def written(tiny, tmp_path):
    """A store of a right write-back chain, one with a wrong block 1, and one of an old (unknown) source."""
    config = config_for("fp8", BLOCK)
    url = f"file://{tmp_path / 'store'}"
    store = Store.open(url, config)
    put_chain(store, tiny, config, tokens(2, BLOCK, seed=1), source="write-back")
    bad = put_chain(store, tiny, config, tokens(2, BLOCK, seed=2), source="write-back", wrong={1: "garbage_prefix"})
    put_chain(store, tiny, config, tokens(1, BLOCK, seed=3), source=None)
    store.close()
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text(f"kv_cache:\n  compression: fp8\n  block_size: {BLOCK}\nstore:\n  url: {url}\n")
    return url, cfg, names(bad)[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_table_by_source_and_exit_1_when_a_copy_differs(written, capsys) -> None:
    url, cfg, bad = written
    code, out, _ = run(capsys, "store", "audit", "--config", str(cfg), "--model", "kvwarm-tiny", "--all")
    assert code == 1
    lines = out.splitlines()
    assert lines[1].split() == ["source", "checked", "agreed", "differed", "quarantined"]
    assert lines[2].split() == ["write-back", "4", "3", "1", "1"] and lines[3].split() == ["unknown", "1", "1", "0", "0"]
    assert lines[5].split() == ["all", "5", "4", "1", "1"]
    assert any(line.startswith("DIFFERS ") and bad in line for line in lines)
    assert any(line.startswith("quarantined -> ") for line in lines)
    code, out, _ = run(capsys, "store", "audit", "--store", url, "--model", "kvwarm-tiny", "--all", "--json")
    again = json.loads(out)
    assert code == 0 and again["checked"] == 4 and again["differed"] == 0 and again["skipped"]["no_prefix"] == 0


def test_json_sample_source_tenant_and_no_quarantine(written, capsys) -> None:
    url, cfg, bad = written
    base = ["store", "audit", "--config", str(cfg), "--model", "kvwarm-tiny", "--json", "--no-quarantine"]
    code, out, _ = run(capsys, *base, "--sample", "1", "--source", "unknown")
    report = json.loads(out)
    assert code == 0 and report["by_source"]["unknown"]["checked"] == 1 and report["checked"] == 1
    code, out, _ = run(capsys, *base, "--tenant", "beta")
    assert code == 0 and json.loads(out)["checked"] == 0  # another namespace: nothing of acme's is read
    code, out, _ = run(capsys, *base, "--tenant", "acme", "--source", "write-back", "--all")
    report = json.loads(out)
    assert code == 1 and report["differed"] == 1 and report["quarantined"] == 0 and bad in report["differences"][0][0]


def test_another_model_exits_2_naming_what_to_pass(tiny, tmp_path, capsys) -> None:
    config = config_for("fp8", BLOCK)
    url = f"file://{tmp_path / 'store'}"
    store = Store.open(url, config)
    put_chain(store, tiny, config, tokens(1, BLOCK, seed=4), source="write-back",
              identity=ModelIdentity("serving-model@7", "tok"))
    store.close()
    code, _, err = run(capsys, "store", "audit", "--store", url, "--all", "--model", "kvwarm-tiny")
    assert code == 2 and err.startswith("prefill: error: model 'kvwarm-tiny' has fingerprint ")  # before it loads
    assert "made by serving-model@7 (1 snapshot): pass --model the directory" in err


@pytest.mark.parametrize("args, message", [
    (["--sample", "0"], "expected a positive whole number"),
    (["--sample", "3", "--all"], "not allowed with argument"),
    (["--tolerance-scale", "4"], "expected a factor above 0 and below 4"),
    (["--budget-s", "0"], "expected positive seconds"),
    (["--source", "engine"], "invalid choice"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as done:
        main(["store", "audit", "--store", f"file://{tmp_path}", "--model", "kvwarm-tiny", *args])
    assert done.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_tenant_name_exits_2_before_the_model_loads(tmp_path, capsys) -> None:
    code, _, err = run(capsys, "store", "audit", "--store", f"file://{tmp_path}", "--model", "/no/such/model",
                       "--tenant", "Not A Name")
    assert code == 2 and "tenant name 'Not A Name' is not allowed" in err
