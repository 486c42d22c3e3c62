"""The KV audit as a task of the maintenance flow, in real flow runs: it quarantines wrong KV, stops at its budget,
and its counts reach audit.json and the report's security-audit family."""
from __future__ import annotations

import json

import pytest

from flows.audit import audit_table
from flows.pipeline import gc_store
from flows.spec import AuditSpec, RunTarget
from prefill.run_results import monitoring_for_run
from prefill.rundir import RunDir
from store.tiers.store import Store
from tests.prefill.audit_store import names, present, put_chain, tokens
from tests.prefill.factories import config_for

BLOCK = 16


@pytest.fixture()
def written(tiny, tmp_path):
    """A config file and a store of three write-back chains, block 1 of one of them wrong: (target, wrong name)."""
    url = f"file://{tmp_path / 'store'}"
    cfg = tmp_path / "kvwarm.yaml"
    cfg.write_text(f"kv_cache:\n  compression: fp8\n  block_size: {BLOCK}\nstore:\n  url: {url}\n")
    config = config_for("fp8", BLOCK)
    store = Store.open(url, config)
    put_chain(store, tiny, config, tokens(2, BLOCK, seed=1), source="write-back")
    bad = put_chain(store, tiny, config, tokens(3, BLOCK, seed=2), source="write-back", wrong={1: "garbage_prefix"})
    put_chain(store, tiny, config, tokens(2, BLOCK, seed=3), source="prefill")
    store.close()
    return RunTarget(store=url, run="maintenance", config_path=str(cfg), model="kvwarm-tiny"), names(bad)[1]


def test_the_maintenance_flow_quarantines_wrong_kv_and_reports_the_counts(prefect_harness, written) -> None:
    target, bad = written
    result = gc_store(target, AuditSpec(budget_gpu_s=600.0, sample=None))
    audit = result["audit"]
    assert (audit["checked"], audit["agreed"], audit["differed"], audit["quarantined"]) == (7, 6, 1, 1)
    assert audit["by_source"]["write-back"]["quarantined"] == 1 and audit["by_source"]["prefill"]["checked"] == 2
    assert bad in audit["differences"][0][0] and bad not in present(Store.open(target.store))
    assert "temp_removed" in result  # GC ran first, as it does without the audit
    run = RunDir.of(target.store, "maintenance")
    assert json.loads(run.audit.read_text()) == audit and run.gc.exists()
    security = monitoring_for_run(target.store, "maintenance").security
    assert (security.kv_audit_checked, security.kv_audit_differed, security.kv_audit_quarantined) == (7, 1, 1)
    assert security.kv_audit_quarantined_by_source == {"write-back": 1, "unknown": 0, "prefill": 0}
    assert audit_table(audit)[-1] == {"source": "all", "checked": 7, "agreed": 6, "differed": 1, "quarantined": 1}


def test_the_budget_stops_the_audit_task_after_the_forward_that_spent_it(prefect_harness, written) -> None:
    target, _ = written
    audit = gc_store(target, AuditSpec(budget_gpu_s=1e-6, sample=None))["audit"]
    assert audit["stopped"] == "budget" and audit["forwards"] == 1  # any forward takes more than a microsecond
    assert audit["checked"] < 7 and audit["checked"] + audit["skipped"]["over_budget"] == 7


def test_without_a_budget_the_maintenance_flow_only_collects_garbage(prefect_harness, written) -> None:
    target, bad = written
    result = gc_store(target)
    assert "audit" not in result and bad in present(Store.open(target.store))
    assert not RunDir.of(target.store, "maintenance").audit.exists()
