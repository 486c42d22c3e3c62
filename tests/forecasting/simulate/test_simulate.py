"""The deployment-shaped replay: scenarios, policies side by side, kvwarm's plans, and the simulate command."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forecasting.ingest.log_trace import requests_from_trace
from forecasting.ingest.traces import from_chains, read_mooncake
from forecasting.planning.cadence import plan_now
from forecasting.simulate.kvwarm_policy import planner_for, retain_spec
from forecasting.simulate.policies import written_back
from forecasting.simulate.prewarm import tree_blocks
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.simulation import Deployment, Scenario, plot, simulate
from forecasting.simulate.tiers import S3_LINK_BYTES_PER_S, NodeShape, TierCosts
from prefill.cli import main
from store.cost import LoadCost, PrefillCost
from store.plan import Plan, PlanEntry, write_plan

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"
HAND = Deployment(NodeShape(gpu_blocks=4, node_blocks=8),
                  TierCosts(PrefillCost(1.0, 0.0), LoadCost(10.0), LoadCost(0.5), block_bytes=1.0))


@pytest.fixture(scope="module")
def head() -> BlockIndex:
    return BlockIndex.build(read_mooncake(MOONCAKE))


def _hand() -> BlockIndex:
    # A conversation (1-2 at 0 s, 1-2-3 at 10 s) around another request at 6 s; one token a block.
    return BlockIndex.build(from_chains([0.0, 6.0, 10.0], [[1, 2], [5], [1, 2, 3]]))


def test_a_restart_keeps_the_node_tier_and_a_replacement_starts_empty() -> None:
    index = _hand()
    scenarios = [Scenario("restart", 5.0, 10.0), Scenario("replacement", 5.0, 10.0)]
    restart, replacement = simulate(index, HAND, scenarios, ("vllm", "reactive-store", "oracle", "belady"))
    # Without the event the conversation's second turn finds 1-2 in the engine's cache.
    assert restart.reference["reactive-store"].hit_tokens == 2
    assert restart.reference["reactive-store"].level_excl_root["gpu"] > 0
    # After the restart the engine's cache is gone but the node tier has 1-2 (written back).
    r = restart.row("reactive-store")
    assert r.requests == 2 and r.hit_tokens == 2 and r.level_excl_root["gpu"] == 0.0 and r.level_excl_root["node"] > 0
    assert restart.row("vllm").hit_tokens == 0
    # A replacement starts with an empty tier: S3 has 1-2 (the old node's uploads landed at 2 and 4 s), but
    # reactive-store's wait for them (4 s) does not beat their 2 s of prefill.
    assert replacement.row("reactive-store").hit_tokens == 0 and replacement.row("belady").hit_tokens == 0
    # The oracle: the link could have carried both between 5 and 10 s, so it loads them from the tier.
    oracle = replacement.row("oracle")
    assert oracle.hit_tokens == 2 and oracle.ttft_mean_s == min(r.ttft_mean_s for r in replacement.rows)


def test_a_scale_out_node_serves_its_share_against_one_that_had_it_from_the_start(head: BlockIndex) -> None:
    sc = Scenario("scale-out", at_s=240.0, window_s=120.0, share=0.3)
    result = simulate(head, Deployment.default(512), [sc], ("vllm", "reactive-store"))[0]
    window = (head.trace.timestamps_s >= 240.0) & (head.trace.timestamps_s < 360.0)
    row = result.row("reactive-store")
    assert 0.15 * window.sum() < row.requests < 0.45 * window.sum()
    assert result.reference["reactive-store"].requests == row.requests
    assert result.reference["reactive-store"].hit_rate > row.hit_rate  # it had its share's history


def test_the_policies_order_as_the_deployment_would_after_a_replacement(head: BlockIndex) -> None:
    deployment = Deployment.default(512)
    requests = requests_from_trace(head.trace)
    planner = planner_for(head.trace, requests, retain_spec(deployment), deployment, cadence_s=120.0)
    result = simulate(head, deployment, [Scenario("replacement", at_s=300.0, window_s=120.0)], planner=planner)[0]
    ttft = {r.policy: r.ttft_mean_s for r in result.rows}
    assert ttft["oracle"] < ttft["reactive-store"] < ttft["vllm"]
    assert ttft["kvwarm"] < ttft["vllm"]
    kv = result.row("kvwarm")
    assert kv.warmup_blocks and 0 < kv.warmup_precision <= 1 and 0 < kv.warmup_recall <= 1
    assert result.reference["kvwarm"].first_minute_hit_rate_excl_root > kv.first_minute_hit_rate_excl_root
    assert "kvwarm" in result.table() and "prefill s" in result.table().splitlines()[0]


def test_kvwarms_plans_are_the_pipelines_own_made_from_the_trace_before_them(head: BlockIndex) -> None:
    from forecasting.simulate.policies import kvwarm_plans

    deployment = Deployment.default(512)
    requests = requests_from_trace(head.trace)
    planner = planner_for(head.trace, requests, retain_spec(deployment), deployment, cadence_s=120.0)
    stored = written_back(head)
    ticks = kvwarm_plans(head, planner, stored, 400.0)
    assert [t.at_s for t in ticks] == [120.0, 240.0, 360.0]
    # measure what ships: the replay's plan is plan_now's, called as the cadence flow calls it
    row = int(np.searchsorted(head.trace.timestamps_s, 240.0))

    def present(tree, nodes):  # noqa: ANN001, ANN202
        dense = tree_blocks(head, tree)[nodes]
        return (dense >= 0) & (stored[np.maximum(dense, 0)] <= row)

    direct = plan_now(requests, planner.origin + pd.Timedelta(seconds=240.0), cost=planner.cost, spec=planner.spec,
                      block_size=512, present=present, created_at=0.0)
    assert ticks[1].plan == direct and len(direct.entries) > 0
    # causality: the trace after 240 s, perturbed, changes nothing in the plans made by then
    late = requests["timestamp"] >= planner.origin + pd.Timedelta(seconds=240.0)
    changed = requests.copy()
    changed.loc[late, "hash_ids"] = pd.Series([np.array([10**9 + i]) for i in range(int(late.sum()))],
                                              index=changed.index[late], dtype=object)
    again = kvwarm_plans(head, planner_for(head.trace, changed, planner.spec, deployment, cadence_s=120.0),
                         stored, 400.0)
    assert [t.plan for t in again[:2]] == [t.plan for t in ticks[:2]] and again[2].plan != ticks[2].plan


def test_the_default_deployment_is_an_8b_model_on_an_h200_at_the_calibrated_costs() -> None:
    d = Deployment.default(512)
    # vLLM: 100 GB of bf16 KV at 131,072 bytes a token; the node tier: 1 TB of blocks of 67,587.875 x 512 bytes
    assert d.shape.gpu_blocks == int(100e9 // (512 * 131072)) == 1490
    assert d.costs.block_bytes == pytest.approx(67587.875 * 512) and d.shape.node_blocks == int(1e12 // 34604992)
    assert d.costs.prefetch_streams == 8 and d.costs.fetch_streams == 2 and d.shape.fetch_mode == "background"
    assert d.costs.s3_bytes_per_s == S3_LINK_BYTES_PER_S == 700e6  # 8 requests at AWS's per-request rate


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)  # the installed command: bad input is exit 2 with "prefill: error: ..."
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_simulate_command_prints_json_and_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--trace", str(MOONCAKE), "--scenario", "restart", "--at", "75%", "--window", "60",
            "--policy", "vllm,reactive-store", "--policy", "belady"]
    rc, out, _ = _run(argv + ["--json"], capsys)
    assert rc == 0
    doc = json.loads(out.strip().splitlines()[-1])
    assert [r["policy"] for r in doc["rows"]] == ["vllm", "reactive-store", "belady"]
    assert doc["scenario"]["at_s"] == pytest.approx(0.75 * read_mooncake(MOONCAKE).duration_s)
    assert doc["deployment"]["gpu_blocks"] == 1490 and doc["trace"]["requests"] == 1409
    assert set(doc["reference"]) == {"vllm", "reactive-store", "belady"}
    rc, out, _ = _run(argv + ["--gpu-kv-bytes", "2e10", "--node-bytes", "1e11"], capsys)
    assert rc == 0 and "vLLM cache 298 blocks, node tier 2889 blocks of 512 tokens; restart" in out
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["vllm", "reactive-store", "belady"]


def test_simulate_command_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    rc, _, err = _run(["simulate", "--trace", str(bad)], capsys)
    assert rc == 2 and "bad.jsonl:1: field 'hash_ids'" in err
    rc, _, err = _run(["simulate", "--trace", str(MOONCAKE), "--at", "soon"], capsys)
    assert rc == 2 and "--at must be seconds" in err
    rc, _, err = _run(["simulate", "--trace", str(MOONCAKE), "--policy", "lru+naive"], capsys)
    assert rc == 2 and "unknown policy 'lru+naive'" in err
    rc, _, err = _run(["simulate", "--trace", str(MOONCAKE), "--node-bytes", "1e6"], capsys)
    assert rc == 2 and "must each hold at least one block" in err


def test_simulate_command_takes_its_cost_model_from_a_bench_result(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "prefill.log"
    result.write_text("noise\n" + json.dumps({"by_tokens": {"2048": {"prefill": {"forward_tokens_per_s": 2048.0}},
                                                            "8192": {"prefill": {"forward_tokens_per_s": 2048.0}}}}))
    argv = ["simulate", "--trace", str(MOONCAKE), "--scenario", "replacement", "--at", "60%", "--window", "60",
            "--policy", "vllm", "--json"]
    rc, out, _ = _run(argv + ["--cost-from", str(result)], capsys)
    slow = json.loads(out.strip().splitlines()[-1])["rows"][0]
    rc2, out, _ = _run(argv, capsys)
    fast = json.loads(out.strip().splitlines()[-1])["rows"][0]
    assert rc == rc2 == 0 and slow["ttft_mean_s"] > 10 * fast["ttft_mean_s"]  # 2,048 tokens/s against an H200's
    rc, _, err = _run(argv + ["--cost-from", str(result), "--s-per-token", "1e-4"], capsys)
    assert rc == 2 and "not both" in err


def test_the_off_peak_plans_prefill_is_stored_at_its_windows_end_and_counted(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Blocks of two tokens; a prompt A B C D asked twice after a replacement at t=20, never before.
    log = tmp_path / "log.jsonl"
    rows = [(t, [9, 9, t % 7, 1]) for t in range(0, 20)] + [(21, [1, 2, 3, 4]), (22, [1, 2, 3, 4, 5])]
    log.write_text("".join(json.dumps({"timestamp": t, "tenant": "a", "token_ids": ids}) + "\n" for t, ids in rows))
    plan = tmp_path / "plan.json"
    write_plan(Plan((PlanEntry("a", token_ids=(1, 2, 3, 4), score=1.0),), window_start=5.0, window_end=10.0), plan)
    argv = ["simulate", "--trace", str(log), "--format", "kvwarm", "--block-size", "2", "--scenario", "replacement",
            "--at", "20", "--window", "10", "--gpu-kv-bytes", "1e9", "--node-bytes", "1e9", "--cadence", "5",
            "--policy", "reactive-store,kvwarm", "--json"]
    rc, out, _ = _run(argv + ["--plan", str(plan)], capsys)
    assert rc == 0
    got = {r["policy"]: r for r in json.loads(out.strip().splitlines()[-1])["rows"]}
    assert got["reactive-store"]["hit_tokens"] == 4  # its own write-back, for the second request
    assert got["kvwarm"]["hit_tokens"] == 8 and got["kvwarm"]["prefill_gpu_s"] > 0  # prefilled, prefetched
    rc, _, err = _run(argv + ["--plan", str(tmp_path / "nope.json")], capsys)
    assert rc == 2 and "nope.json' does not exist" in err


def test_plots_are_written_or_refused_before_replaying(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       head: BlockIndex) -> None:
    argv = ["simulate", "--trace", str(MOONCAKE), "--policy", "vllm", "--scenario", "restart", "--window", "60",
            "--plots", str(tmp_path)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        rc, out, err = _run(argv, capsys)
        assert rc == 2 and "needs matplotlib" in err and out == ""
        return
    rc, out, _ = _run(argv, capsys)
    assert rc == 0 and (tmp_path / "simulate-restart.png").exists()
    result = simulate(head, Deployment.default(512), [Scenario("restart", 300.0, 60.0)], ("vllm", "reactive-store"))[0]
    assert plot(result, tmp_path / "p" / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
