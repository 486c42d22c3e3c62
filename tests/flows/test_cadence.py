"""The short-cadence plan flow, run for real on Mooncake-format logs (hash ids), end to end."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from flows.cadence import plan_cadence
from flows.spec import CadenceSpec, MiningSpec, RunTarget
from forecasting.ingest.log_trace import requests_from_trace
from forecasting.ingest.traces import read_mooncake
from prefill.rundir import RunDir
from store.plan import read_plan
from store.published_plan import latest_plan
from store.tiers.store import Store

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_head.jsonl"
ORIGIN = pd.Timestamp("2026-03-02 09:00:00")


def _write_logs(rows: pd.DataFrame, path: Path) -> Path:
    with path.open("w") as f:
        for r in rows.itertuples(index=False):
            f.write(json.dumps({"timestamp": r.timestamp.isoformat(), "tenant": r.tenant, "model": "kvwarm-tiny",
                                "hash_ids": [int(h) for h in r.hash_ids], "prompt_tokens": int(r.prompt_tokens)})
                    + "\n")
    return path


def test_the_cadence_flow_plans_from_the_logs_before_its_time_and_publishes_the_plan(prefect_harness,
                                                                                     tmp_path: Path) -> None:
    rows = requests_from_trace(read_mooncake(MOONCAKE), origin=ORIGIN)
    as_of = ORIGIN + pd.Timedelta(seconds=300)
    logs = _write_logs(rows, tmp_path / "logs.jsonl")
    store = f"file://{tmp_path / 'store'}"
    target = RunTarget(store=store, run="live", model="kvwarm-tiny", block_size=16)
    spec = CadenceSpec(node_bytes=float(1 << 30))
    path = plan_cadence(target, MiningSpec(logs=str(logs)), spec, as_of=str(as_of))
    plan = read_plan(path)
    assert Path(path) == RunDir.of(store, "live").cadence_plan
    assert plan.as_of == as_of.value / 1e9 and plan.extra["requests"] == int((rows["timestamp"] < as_of).sum())
    retain = [e for e in plan.entries if e.action == "retain"]
    assert retain and all(e.hash_ids for e in retain)
    # one value model chooses the plan; the retain entries are listed (so copied) most urgent first
    urgency = [e.urgency for e in retain]
    assert all(u is not None for u in urgency) and urgency == sorted(urgency, reverse=True)
    # every retained block was logged before the plan's time
    seen = {int(h) for ids in rows.loc[rows["timestamp"] < as_of, "hash_ids"] for h in ids}
    later = {int(h) for ids in rows.loc[rows["timestamp"] >= as_of, "hash_ids"] for h in ids} - seen
    named = {h for e in retain for h in e.hash_ids}
    assert named <= seen and later and not named & later
    # what engines started with plan: latest prefetch: the plan keyed, never its trace ids (a loader
    # keys token ids: hash-id entries were never a node's to copy), with what ranks the fleet's memory
    latest = latest_plan(Store.open(store).tiers)
    assert latest.entries == () and latest.extra["unpublished"] == {"hash_ids": len(plan.entries)}
    assert latest.as_of == plan.as_of and latest.extra.get("fleet_reuse") == plan.extra.get("fleet_reuse")
    # the budget holds: a block of 16 tokens of kvwarm-tiny's KV per hash id, under node_bytes
    blocks = {h for e in retain for h in e.hash_ids}
    assert plan.extra["retain_bytes"] <= spec.node_bytes and plan.extra["retain_blocks"] >= len(blocks) > 0
    assert np.isfinite(plan.extra["retain_bytes"])
