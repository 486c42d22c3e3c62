"""The replay benchmark's evaluation and tuning modes, on the Mooncake head in tests/data."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import replay_bench
from bench.lib import replay_analysis
from bench.lib.ceiling import first_use_auc
from forecasting.ingest.traces import read_mooncake
from forecasting.simulate.prewarm import kvwarm_prewarm, oracle_prewarm
from forecasting.simulate.replay import BlockIndex, LRUCache, PredictorConfig, replay
from forecasting.simulate.simulation import Scenario, simulate

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_head.jsonl"
SMALL = ["--trace", str(MOONCAKE), "--quick", "--capacity", "4096", "--steady-capacity", "2048", "--window", "120"]


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_evaluation_reports_targets_settings_and_diagnostics(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_bench.main(SMALL + ["--out", str(tmp_path)]) == 0
    summary = _last_json(capsys)
    assert summary["predictor"]["horizon_s"] == 300.0 and "20/40/60/80" in summary["tuned_on"]
    assert set(summary["targets"]) >= {"prewarm_gap_closed.lru+kvwarm", "retention_gap_closed_4k"}
    diag = summary["diagnostics_gap_closed"]["restart50"]
    assert set(diag) == {"kvwarm_set_oracle_order", "oracle_set_kvwarm_order"}
    # the figures are the library's, recomputed here on the same restart (at 50 % of the trace)
    index = BlockIndex.build(read_mooncake(MOONCAKE))
    scenario = Scenario("restart", at_s=0.5 * index.trace.duration_s, window_s=120.0)
    result = simulate(index, 4096, scenario, ["lru", "lru+oracle"], predictor=PredictorConfig())
    cold, best = (result.row(p).hit_rate_excl_root for p in ("lru", "lru+oracle"))
    rates = replay_analysis.diagnose(index, result, 4096, PredictorConfig())
    assert diag == pytest.approx({k: replay_analysis.gap(v, cold, best) for k, v in rates.items()}, abs=1e-3)
    # kvwarm's shortfall there is its set, not its order
    assert diag["oracle_set_kvwarm_order"] > diag["kvwarm_set_oracle_order"]
    assert (tmp_path / "replay_bench.json").exists()


def test_tuning_never_uses_the_evaluation_points(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_bench.main(SMALL + ["--tune"]) == 0
    summary = _last_json(capsys)
    assert summary["mode"] == "tune"
    assert not set(summary["fractions"]) & set(replay_bench.EVAL_FRACTIONS)
    assert 4096 not in summary["steady_capacities"]
    assert len(summary["grid"]) == 2 and summary["chosen"] in summary["grid"]
    assert not set(replay_analysis.TUNE_FRACTIONS) & set(replay_bench.EVAL_FRACTIONS)


def test_the_diagnostic_measures_as_the_simulator_does() -> None:
    index = BlockIndex.build(read_mooncake(MOONCAKE))
    result = simulate(index, 4096, Scenario("restart", at_s=240.0, window_s=120.0), ["lru+kvwarm", "lru+oracle"])
    ts = index.trace.timestamps_s
    start = int(np.searchsorted(ts, 240.0))
    served = np.arange(start, int(np.searchsorted(ts, 360.0)))
    for policy, blocks in (("lru+kvwarm", kvwarm_prewarm(index, start, 4096)[0]),
                           ("lru+oracle", oracle_prewarm(index, start, served, 4096))):
        cache = LRUCache(4096)
        cache.load(blocks.tolist())
        rate = replay_analysis.excl_root_rate(index, served, replay(index, cache, served))
        assert rate == pytest.approx(result.row(policy).hit_rate_excl_root)
    diag = replay_analysis.diagnose(index, result, 4096, PredictorConfig())
    # Here, as on the full trace, the oracle's set beats kvwarm's even in kvwarm's order: the shortfall is the set.
    assert diag["oracle_set_kvwarm_order"] >= result.row("lru+kvwarm").hit_rate_excl_root


def test_ceiling_calibrates_on_the_tuning_points_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_bench.main(SMALL + ["--ceiling"]) == 0
    summary = _last_json(capsys)
    assert summary["mode"] == "ceiling" and not set(summary["fractions"]) & set(replay_bench.EVAL_FRACTIONS)
    curve = summary["prewarm"]
    assert set(curve) == {"kvwarm"} | {f"oracle_error_sd{sd:g}" for sd in replay_analysis.NOISE_SDS}
    aucs = [curve[f"oracle_error_sd{sd:g}"]["auc"] for sd in replay_analysis.NOISE_SDS]
    assert aucs == sorted(aucs, reverse=True) and all(0.5 < a <= 1.0 for a in aucs)  # more error, worse ranking
    assert 0.5 < summary["auc_needed_for_target"] < 1.0
    split = summary["retention_hits"]["2048"]
    assert split["belady"]["first_reuse"] >= split["retention"]["first_reuse"]
    index = BlockIndex.build(read_mooncake(MOONCAKE))
    assert summary["first_use_auc_180s"] == pytest.approx(first_use_auc(index, 180.0), abs=1e-3)
