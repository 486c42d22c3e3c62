"""Scenarios, prewarms, metrics and the simulate command, on hand-made and real (Mooncake) traces."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from forecasting.ingest.traces import from_chains, read_mooncake
from forecasting.simulate.prewarm import kvwarm_prewarm, naive_prewarm, oracle_prewarm
from forecasting.simulate.replay import BlockIndex, PredictorConfig
from forecasting.simulate.simulation import Policy, Scenario, plot, simulate
from prefill.cli import main
from store.cost import PrefillCost
from store.plan import Plan, PlanEntry, write_plan
from tests.forecasting.simulate.hand_traces import REPLAY_CHAINS, perturbed

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"


@pytest.fixture(scope="module")
def mooncake() -> BlockIndex:
    return BlockIndex.build(read_mooncake(MOONCAKE))


def test_restart_on_a_hand_made_trace() -> None:
    # Requests one second apart, one token per block, cache of 3, restart at t=2 (request 2).
    index = BlockIndex.build(from_chains([0.0, 1.0, 2.0, 3.0, 4.0], REPLAY_CHAINS))
    result = simulate(index, 3, Scenario("restart", at_s=2.0, window_s=10.0, bucket_s=1.0),
                      ["lru", "lru+oracle", "belady"])
    ref, cold, oracle, belady = result.reference, result.row("lru"), result.row("lru+oracle"), result.row("belady")
    # No restart: hits 2, 1, 2 of 3 + 2 + 3 tokens. Cold: 0, 1, 2.
    assert (ref.hit_tokens, ref.tokens, ref.requests) == (5, 8, 3)
    assert cold.hit_tokens == 3 and cold.hit_rate == pytest.approx(3 / 8)
    # Excluding the root block: cold hits 0, 0, 1 of 2 + 1 + 2 tokens.
    assert cold.hit_rate_excl_root == pytest.approx(1 / 5)
    assert [r for _, r in cold.per_bucket] == pytest.approx([0.0, 0.0, 0.5])
    assert [m for m, _ in cold.per_bucket] == pytest.approx([0.0, 1 / 60, 2 / 60])
    # The reference's buckets: 1/2, 0, 1/2; cold first reaches 90 % of it in the second bucket.
    assert [r for _, r in ref.per_bucket] == pytest.approx([0.5, 0.0, 0.5])
    assert cold.minutes_to_recover == pytest.approx(1 / 60)
    # Oracle prewarm: blocks 1, 2, 3 (seen before, used after), 3 is used last so it goes first.
    assert oracle.hit_tokens == 5 and oracle.warmup_precision == 1.0 and oracle.warmup_recall == 1.0
    assert oracle.prewarm_blocks == 3 and oracle.minutes_to_recover == 0.0
    # Belady after r3 drops block 3 (never used again) rather than 4: hits 0, 1, 3.
    assert belady.hit_tokens == 4
    assert cold.prefill_tokens_saved == 3


def test_the_simulation_turns_hit_tokens_into_ttft_with_the_prefill_cost() -> None:
    cost = PrefillCost(s_per_token=1e-3, s_per_token_pair=1e-6)
    index = BlockIndex.build(from_chains([0.0, 1.0], [[1, 2], [1, 2]], block_tokens=100))
    r = simulate(index, 8, Scenario("steady"), ["lru"], cost=cost).row("lru")
    assert r.hit_tokens == 200 and r.ttft_saved_s == pytest.approx(cost.seconds(200))
    assert r.ttft_saved_mean_s == pytest.approx(r.ttft_saved_s / 2)
    # Time to first token: the first request prefills all 200 tokens, the second none.
    full = cost.seconds(200)
    assert r.ttft_p50_s == pytest.approx(full / 2) and r.ttft_p99_s == pytest.approx(0.99 * full)


CALIBRATION = Path(__file__).resolve().parents[3] / "bench" / "calibration" / "prefill-h200-8b.json"


def test_simulate_command_takes_its_cost_model_from_a_bench_result(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--trace", str(MOONCAKE), "--capacity-blocks", "512", "--policy", "lru", "--json"]
    rc, out, _ = _run(base, capsys)
    default = json.loads(out.strip().splitlines()[-1])["rows"][0]
    # A captured run of the bench (progress lines, then the JSON) twice as fast as the H200's figures.
    doc = json.loads(CALIBRATION.read_text())
    for r in doc["by_tokens"].values():
        r["prefill"]["forward_tokens_per_s"] *= 2
    log = tmp_path / "prefill_bench.log"
    log.write_text("8b: 8030M parameters\n2048 tokens: ...\n" + json.dumps(doc) + "\n")
    rc, out, _ = _run(base + ["--cost-from", str(log)], capsys)
    fast = json.loads(out.strip().splitlines()[-1])["rows"][0]
    assert rc == 0 and fast["ttft_saved_s"] == pytest.approx(default["ttft_saved_s"] / 2, rel=1e-3)
    rc, _, err = _run(base + ["--cost-from", str(log), "--s-per-token", "1e-4"], capsys)
    assert rc == 2 and "not both" in err
    log.write_text("no json here\n")
    rc, _, err = _run(base + ["--cost-from", str(log)], capsys)
    assert rc == 2 and "cannot read a JSON result" in err


def test_policy_and_scenario_arguments_are_checked(mooncake: BlockIndex) -> None:
    assert Policy.parse("retention+kvwarm") == Policy("retention", "kvwarm")
    assert Policy.parse("lru").name == "lru"
    with pytest.raises(ValueError, match="lru, retention, belady"):
        Policy.parse("fifo")
    with pytest.raises(ValueError, match="naive, kvwarm, oracle"):
        Policy.parse("lru+magic")
    with pytest.raises(ValueError, match="takes no prewarm"):
        Policy.parse("belady+oracle")
    with pytest.raises(ValueError, match="steady, restart, scale-out"):
        Scenario("crash")
    with pytest.raises(ValueError, match="need an event"):
        simulate(mooncake, 100, Scenario("steady"), ["lru+kvwarm"])
    with pytest.raises(ValueError, match="outside the trace"):
        simulate(mooncake, 100, Scenario("restart", at_s=10_000), ["lru"])
    with pytest.raises(ValueError, match="at least one block"):
        simulate(mooncake, 0, Scenario("steady"), ["lru"])


def test_prewarms_see_nothing_after_the_prewarm_time(mooncake: BlockIndex) -> None:
    t = 300.0
    trace = mooncake.trace
    config = PredictorConfig(horizon_s=60, tau_s=120)
    other = BlockIndex.build(perturbed(trace, t))
    picks = []
    for index in (mooncake, other):
        start = int(np.searchsorted(index.trace.timestamps_s, t))
        naive = index.original[naive_prewarm(index, start, 3000, 240.0)].tolist()
        blocks, scores = kvwarm_prewarm(index, start, 3000, config)
        served = np.arange(start, len(index.trace))
        oracle = index.original[oracle_prewarm(index, start, served, 3000)].tolist()
        picks.append((naive, index.original[blocks].tolist(), scores.tolist(), oracle))
    (n1, k1, s1, o1), (n2, k2, s2, o2) = picks
    assert n1 == n2 and k1 == k2 and s1 == s2
    assert len(k1) == 3000 and len(set(np.round(s1, 6))) > 100  # a real ranking, not a constant
    assert o1 != o2  # the oracle does read the future: the perturbation is visible after t


def test_kvwarm_prewarm_is_closed_under_prefixes(mooncake: BlockIndex) -> None:
    start = int(np.searchsorted(mooncake.trace.timestamps_s, 400.0))
    blocks, scores = kvwarm_prewarm(mooncake, start, 2000, PredictorConfig(horizon_s=60))
    chosen = set(blocks.tolist())
    parents = mooncake.parent[blocks]
    assert all(p == -1 or p in chosen for p in parents.tolist())
    assert np.all(np.diff(scores) >= 0)  # least valuable first


def test_restart_on_real_traffic_orders_the_policies(mooncake: BlockIndex) -> None:
    scenario = Scenario("restart", at_s=360.0, window_s=120.0, lookback_s=300.0)
    config = PredictorConfig(horizon_s=60, tau_s=120)
    result = simulate(mooncake, 2048, scenario, ["lru", "lru+naive", "lru+kvwarm", "lru+oracle", "belady"],
                      predictor=config)
    cold, oracle = result.row("lru"), result.row("lru+oracle")
    assert oracle.hit_rate_excl_root > cold.hit_rate_excl_root
    assert oracle.first_bucket_hit_rate_excl_root > cold.first_bucket_hit_rate_excl_root
    for name in ("lru+naive", "lru+kvwarm"):
        r = result.row(name)
        assert r.prewarm_blocks == 2048 and 0 < r.warmup_precision < 1 and 0 < r.warmup_recall <= 1
        assert r.first_bucket_hit_rate_excl_root > cold.first_bucket_hit_rate_excl_root
    assert result.row("belady").hit_tokens >= cold.hit_tokens
    assert {r.requests for r in result.rows} == {result.reference.requests}
    assert "lru+kvwarm" in result.table()
    doc = json.loads(json.dumps(result.to_json()))  # JSON-ready: it survives a round trip, figures intact
    assert [r["policy"] for r in doc["rows"]] == ["lru", "lru+naive", "lru+kvwarm", "lru+oracle", "belady"]
    assert [r["hit_rate_excl_root"] for r in doc["rows"]] == [r.hit_rate_excl_root for r in result.rows]
    assert doc["reference"]["requests"] == result.reference.requests and doc["capacity_blocks"] == 2048
    assert doc["scenario"]["kind"] == "restart" and doc["window_s"] == list(result.window)


def test_scale_out_serves_a_share_and_compares_with_an_established_replica(mooncake: BlockIndex) -> None:
    scenario = Scenario("scale-out", at_s=300.0, window_s=150.0, share=0.5, seed=3)
    result = simulate(mooncake, 1024, scenario, ["lru", "lru+oracle"])
    total = int(((mooncake.trace.timestamps_s >= 300) & (mooncake.trace.timestamps_s < 450)).sum())
    assert 0.35 * total < result.row("lru").requests < 0.65 * total
    assert result.reference.requests == result.row("lru").requests
    assert result.row("lru+oracle").hit_tokens > result.row("lru").hit_tokens


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)  # the installed command: bad input is exit 2 with "prefill: error: ..."
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_simulate_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-blocks", "1024", "--scenario", "restart",
                       "--at", "75%", "--window", "60", "--policy", "lru,lru+oracle", "--policy", "retention",
                       "--json"], capsys)
    assert rc == 0
    doc = json.loads(out.strip().splitlines()[-1])
    assert [r["policy"] for r in doc["rows"]] == ["lru", "lru+oracle", "retention"]
    assert doc["scenario"]["at_s"] == pytest.approx(0.75 * read_mooncake(MOONCAKE).duration_s)
    assert doc["capacity_blocks"] == 1024 and doc["trace"]["requests"] == 1409
    assert doc["reference"]["policy"].startswith("no-event")


def test_simulate_command_table_and_bytes_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    # 512-token blocks of 1000 bytes a token: 512,000 bytes a block, so 2.6e8 bytes hold 507 blocks.
    rc, out, _ = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-bytes", "2.6e8",
                       "--kv-bytes-per-token", "1000"], capsys)
    assert rc == 0
    assert "507 blocks of 512 tokens; steady" in out
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["lru", "retention", "belady"]
    # By default a token is the 8B geometry's in the store: 31 FP8 layers, layer 0 in bf16, the
    # scales: 2 x 8 x 128 x (31 + 2) + 31 x 2 x 8 x 4 / 512 = 67,587.875 bytes, 34,604,992 a block.
    rc, out, _ = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-bytes", "1e10", "--policy", "lru"], capsys)
    assert rc == 0 and f"{int(1e10 // 34_604_992)} blocks of 512 tokens" in out
    rc, _, err = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-bytes", "1e7", "--policy", "lru"], capsys)
    assert rc == 2 and "holds no block (512 tokens x 67587.9 bytes each)" in err


def test_simulate_command_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    rc, _, err = _run(["simulate", "--trace", str(bad), "--capacity-blocks", "10"], capsys)
    assert rc == 2 and "bad.jsonl:1: field 'hash_ids'" in err
    rc, _, err = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-blocks", "10", "--scenario", "restart",
                       "--at", "soon"], capsys)
    assert rc == 2 and "--at must be seconds" in err
    rc, _, err = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-blocks", "10", "--policy", "lru+naive"],
                      capsys)
    assert rc == 2 and "need an event" in err


def test_plots_without_matplotlib_fail_before_replaying(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        rc, out, err = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-blocks", "64", "--plots",
                             str(tmp_path)], capsys)
        assert rc == 2 and "needs matplotlib" in err and out == ""
    else:
        rc, out, _ = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-blocks", "64", "--plots",
                           str(tmp_path)], capsys)
        assert rc == 0 and (tmp_path / "simulate-steady-64.png").exists()


def test_plot_writes_a_png(mooncake: BlockIndex, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = simulate(mooncake, 512, Scenario("restart", at_s=300.0, window_s=120.0), ["lru", "lru+oracle"])
    path = plot(result, tmp_path / "plots" / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_prewarm_replays_the_pipelines_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Blocks of two tokens. Before the restart at t=2: A B and C D; after it: A B (+ a partial block), then C.
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"timestamp": t, "tenant": "a", "token_ids": ids}) + "\n" for t, ids in
                           [(0, [1, 2, 3, 4]), (1, [5, 6, 7, 8]), (2, [1, 2, 3, 4, 9]), (3, [5, 6])]))
    plan = tmp_path / "plan.json"
    write_plan(Plan((PlanEntry("a", token_ids=(1, 2, 3, 4)),)), plan)
    argv = ["simulate", "--trace", str(log), "--format", "kvwarm", "--block-size", "2", "--capacity-blocks", "2",
            "--scenario", "restart", "--at", "2", "--window", "10"]
    rc, out, _ = _run(argv + ["--plan", str(plan), "--json"], capsys)
    assert rc == 0
    doc = json.loads(out.strip().splitlines()[-1])
    rows = {r["policy"]: r for r in doc["rows"]}
    assert "lru+plan" in rows and doc["plan"] == {"path": str(plan), "blocks": 2, "blocks_in_trace": 2}
    assert rows["lru"]["hit_tokens"] == 0 and rows["lru"]["tokens"] == 7
    # The plan's A B serve the first request after the restart; C was not planned.
    warm = rows["lru+plan"]
    assert warm["hit_tokens"] == 4 and warm["prewarm_blocks"] == 2
    assert warm["warmup_precision"] == 1.0 and warm["warmup_recall"] == pytest.approx(2 / 3)
    assert rows["lru+oracle"]["hit_tokens"] == 4
    # A plan whose most valuable entry the trace never asks for fills the cache with dead blocks.
    write_plan(Plan((PlanEntry("a", token_ids=(9, 9, 9, 9)), PlanEntry("a", token_ids=(1, 2, 3, 4)))), plan)
    rc, out, _ = _run(argv + ["--plan", str(plan), "--policy", "lru+plan", "--json"], capsys)
    row = json.loads(out.strip().splitlines()[-1])["rows"][0]
    assert rc == 0 and row["hit_tokens"] == 0 and row["warmup_precision"] == 0.0
    # The table names the plan; a plan prewarm without a plan, or a missing file, is a clear error.
    rc, out, _ = _run(argv + ["--plan", str(plan)], capsys)
    assert rc == 0 and f"plan {plan}: 4 blocks, 2 of them in the trace" in out and "lru+plan" in out
    rc, _, err = _run(argv + ["--policy", "lru+plan"], capsys)
    assert rc == 2 and "the plan prewarm needs a plan: pass --plan FILE" in err
    rc, _, err = _run(argv + ["--plan", str(tmp_path / "nope.json")], capsys)
    assert rc == 2 and "nope.json' does not exist" in err
    rc, _, err = _run(["simulate", "--trace", str(MOONCAKE), "--capacity-blocks", "8", "--scenario", "restart",
                       "--plan", str(plan)], capsys)
    assert rc == 2 and "needs a trace with block keys" in err
