"""The Prefect pipeline end to end on a small slice, its failures, and reruns."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pandas as pd
import pytest

from flows.pipeline import kvwarm_pipeline, plan_prewarm, prefill_plan
from flows.spec import RunSpec, RunTarget
from flows.tasks import FlowInputError, run_dir, transient
from prefill.rundir import RunDir
from store.format.payload import canonical_layout, map_file
from store.format.snapshot import read_snapshot
from store.plan import read_plan
from store.tiers.base import SUFFIX

TRAIN_END = "2026-03-04"
#: the sample logs' prompts are short: 16-token blocks (the config's default, 256, would find no prefix)
BLOCK = 16


def _snapshots(store: Path) -> list[Path]:
    return [p for p in store.rglob("*") if p.is_file() and "_flows" not in p.parts and p.suffix != ".sqlite"
            and not p.name.startswith((".", "index"))]


@pytest.fixture(scope="module")
def pipeline_run(prefect_harness, small_logs, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    url = f"file://{store}"
    result = kvwarm_pipeline(RunSpec.model_validate({"target": {"store": url, "run": "t", "block_size": BLOCK},
                                                     "mining": {"logs": small_logs, "end": TRAIN_END}}))
    return store, url, result


def test_the_pipeline_mines_plans_prefills_and_reports(pipeline_run) -> None:
    store, url, result = pipeline_run
    out = RunDir.of(url, "t")
    plan = read_plan(out.plan)
    assert plan.entries and plan.block_size == 16 and plan.model == "kvwarm-tiny"
    assert pd.Timestamp(plan.window_start, unit="s") >= pd.Timestamp(TRAIN_END)  # the window is in the future
    window = json.loads(out.window.read_text())
    # under three days of history there are no past days to score load predictors on
    assert window["source"] == {"name": "forecast", "regrets": {}}
    assert all(e.token_ids and len(e.token_ids) % 16 == 0 for e in plan.entries)
    prefill = json.loads(out.prefill.read_text())
    assert prefill["blocks_written"] == prefill["blocks_total"] > 0
    assert len(_snapshots(store)) >= prefill["blocks_written"]
    # Storage was priced at what a block takes in the store: its payload (kept layer 0 and scales included).
    snap = read_snapshot(map_file(next(p for p in _snapshots(store) if p.suffix == SUFFIX)))
    assert plan.extra["kv_bytes_per_token"] == canonical_layout(snap.header).nbytes / BLOCK
    demand = pd.read_parquet(out.demand_table("series"))
    assert demand["ds"].max() < pd.Timestamp(TRAIN_END)  # trained only before train_end
    summary = json.loads(out.report.read_text())
    assert summary["plan"]["entries"] == len(plan.entries)
    assert summary["prefill"]["blocks_written"] == prefill["blocks_written"]
    for png in summary["plots"].values():
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["plan"] == str(out.plan)


def test_a_rerun_writes_no_block_twice(pipeline_run) -> None:
    store, url, _ = pipeline_run
    before = len(_snapshots(store))
    again = prefill_plan(RunTarget(store=url, run="t", block_size=BLOCK))
    assert again["blocks_written"] == 0
    assert again["blocks_stored_before"] == again["blocks_total"] > 0
    assert len(_snapshots(store)) == before


def test_a_missing_logs_path_fails_the_flow_with_the_reason(prefect_harness, tmp_path) -> None:
    state = kvwarm_pipeline({"target": {"store": f"file://{tmp_path / 'store'}", "run": "bad"},
                             "mining": {"logs": str(tmp_path / "nope.jsonl")}}, return_state=True)
    assert state.is_failed()
    assert "nope.jsonl" in state.message and "does not exist" in state.message
    with pytest.raises(FlowInputError, match="does not exist"):
        state.result()


def test_a_stage_run_out_of_order_says_which_stage_to_run_first(prefect_harness, tmp_path) -> None:
    state = plan_prewarm(RunTarget(store=f"file://{tmp_path / 'store'}", run="empty"), return_state=True)
    assert state.is_failed() and "mine_logs" in state.message


def test_run_paths() -> None:
    assert run_dir(RunTarget(store="file:///var/cache/kv,s3://b/p", run="r")).path == Path("/var/cache/kv/_flows/r")
    with pytest.raises(FlowInputError, match="target.run is not set"):
        run_dir(RunTarget(store="file:///var/cache/kv"))


def test_bad_input_is_not_retried_but_io_errors_are() -> None:
    class State:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def result(self):
            raise self.exc

    assert not transient(None, None, State(FlowInputError("bad path")))
    assert transient(None, None, State(OSError("connection reset")))


def test_the_demo_replays_the_planned_period_through_the_loader(prefect_harness, small_logs, tmp_path, capsys) -> None:
    from flows.demo import run

    out = run(f"file://{tmp_path / 'store'}", logs=small_logs, run_name="demo")
    rep = out["replay"]
    assert out["plan_entries"] > 0 and rep["requests"] > 0
    assert 0 < rep["requests_hit"] <= rep["requests"]
    assert 0 < rep["cached_tokens"] < rep["prompt_tokens"]
    # the warm-up accuracy scores the plan the demo made against the period it replayed
    acc = out["accuracy"]
    assert acc["planned"] == out["plan_entries"] and acc["requests"] == rep["requests"]
    assert acc["used"] > 0 and acc["precision"] == pytest.approx(acc["used"] / acc["planned"])
    assert acc["covered"] > 0 and acc["recall"] == pytest.approx(acc["covered"] / acc["requests"])
    assert out["seconds_saved"] > 0
    text = capsys.readouterr().out
    assert "hit rate:" in text and "warm-up accuracy:" in text and "TTFT saved:" in text
    for png in out["plots"].values():
        assert Path(png).exists()
    # The what-if replays the logs through prefill simulate's deployment-shaped replay, with a
    # restart and a replacement at the window's end. A new node's engine alone is what the cold
    # store with write-back is: with no evictions in a period this small, the replay reproduces
    # the store's baseline to the token.
    what = out["whatif"]
    assert what["replacement"]["vllm"]["hit_rate"] == pytest.approx(rep["cold_cached_tokens"] / rep["prompt_tokens"])
    for kind in ("restart", "replacement"):
        got = what[kind]
        assert got["vllm"]["hit_rate"] <= got["reactive-store"]["hit_rate"] <= got["no-event"]["hit_rate"]
        assert Path(what["plots"][kind]).exists()
    assert what["replacement"]["kvwarm"]["prefetched_blocks"] > 0  # a new node prefetches the latest plan
    assert "what-if at" in text and f"rerun: {what['command']}" in text
    assert "the live node after the replacement" in text
    # The printed command reruns it from the logs themselves, to the same figures.
    from prefill.cli import main

    assert main(shlex.split(what["command"])[1:] + ["--policy", "vllm,reactive-store,kvwarm", "--json"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    for policy in ("vllm", "reactive-store", "kvwarm"):
        assert rows[policy]["hit_rate"] == pytest.approx(what["replacement"][policy]["hit_rate"])
        assert 1e3 * rows[policy]["ttft_mean_s"] == pytest.approx(what["replacement"][policy]["ttft_mean_ms"])
    # The next run of this store adapts the LSH threshold by the hit rate the demo's loaders measured.
    from flows.pipeline import forecast_demand, mine_logs
    from forecasting.mining.families import adapt_threshold

    store = f"file://{tmp_path / 'store'}"
    first = json.loads(RunDir.of(store, "demo").mine.read_text())["similarity"]
    assert first["source"] == "config" and first["threshold"] == 0.85
    nxt = RunTarget(store=store, run="next", block_size=BLOCK)
    mine_logs(nxt, {"logs": small_logs})
    chosen = json.loads(RunDir.of(store, "next").mine.read_text())["similarity"]
    assert chosen["source"] == "adapted" and chosen["from_run"] == "demo"
    assert chosen["hit_rate"] == pytest.approx(out["monitoring"]["cache_efficiency"]["request_hit_rate"])
    assert chosen["threshold"] == pytest.approx(adapt_threshold(0.85, chosen["hit_rate"]))
    # ... and its planner budgets GPU seconds at the prefill rate the demo's prefill measured.
    forecast_demand(nxt)
    plan_prewarm(nxt)
    planned = read_plan(RunDir.of(store, "next").plan)
    rate = planned.extra["prefill_rate"]
    assert rate["source"] == "measured" and rate["from_run"] == "demo"
    assert rate["tokens_per_s"] == pytest.approx(out["prefill"]["tokens_per_s"])
    # ... and publishes its plan as the store's latest, for serving engines started with plan: latest:
    # keyed for the model (salted block keys, no prompt), in the plan's order.
    from flows.tasks import flow_config
    from prefill.plan_keys import published
    from store.published_plan import LATEST_PLAN, latest_plan
    from store.tiers.store import Store

    tiers = Store.open(store).tiers
    latest = latest_plan(tiers)
    assert latest == published(planned, nxt.model, flow_config(nxt))
    assert [e.namespace for e in latest.entries] == [e.tenant for e in planned.entries if e.token_ids or e.text]
    assert b"token_ids" not in tiers[0].get_meta(LATEST_PLAN) and b'"text"' not in tiers[0].get_meta(LATEST_PLAN)
