"""The replay benchmark's evaluation and tuning modes, on the Mooncake head in tests/data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import replay_bench
from bench.lib import replay_analysis
from forecasting.simulate.metrics import PolicyResult
from forecasting.simulate.simulation import Scenario, SimResult

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_head.jsonl"
# The head is 477 s long: a 60 s cadence gives plans before the events at 50 %.
SMALL = ["--trace", str(MOONCAKE), "--quick", "--window", "120", "--cadence", "60"]


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_evaluation_prints_every_policy_per_event_and_a_json_last_line(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_bench.main(SMALL + ["--out", str(tmp_path), "--results", str(tmp_path)]) == 0
    doc = _last_json(capsys)
    assert set(doc["events"]) == {"restart50", "replacement50", "scale-out50", "steady"}
    for name, ev in doc["events"].items():
        assert list(ev["ttft_mean_ms"]) == ["vllm", "reactive-store", "kvwarm", "restore", "oracle", "belady"], name
        bounded = {p: v for p, v in ev["ttft_mean_ms"].items() if p != "belady"}  # belady replaces vLLM's eviction
        assert ev["ttft_mean_ms"]["oracle"] == min(bounded.values()), name  # the bound
    rep = doc["events"]["replacement50"]
    assert rep["ttft_mean_ms"]["oracle"] < rep["ttft_mean_ms"]["reactive-store"] <= rep["ttft_mean_ms"]["vllm"]
    assert set(rep["restore"]) == set(rep["kvwarm"])  # the same figures against reactive-store
    # every headline figure at 1 Gb/s, the default link and 100 Gb/s
    assert [r["s3_gbps"] for r in doc["per_link"]] == [1.0, 5.6, 100.0]
    for r in doc["per_link"]:
        assert set(r["summary"]) == {"restart", "replacement", "scale-out"} and "restore" in r["summary"]["replacement"]
    assert doc["per_link"][1]["ttft_mean_ms"] == {k: v["ttft_mean_ms"] for k, v in doc["events"].items()}
    kv = rep["kvwarm"]
    assert kv["prefetched_blocks"] > 0 and kv["prefill_gpu_s"] == 0.0  # no off-peak plan on a Mooncake trace
    saved = rep["ttft_mean_ms"]["reactive-store"] - rep["ttft_mean_ms"]["kvwarm"]
    assert kv["ttft_saved_vs_reactive_ms"] == pytest.approx(saved, abs=0.02)
    assert set(doc["targets"]) == {f"{k}_{t}" for k in ("replacement", "scale_out")
                                   for t in ("gap_closed", "ttft_below_restore_ms", "first_minute_above_restore_pct",
                                             "first_minute_vs_oracle")} | {"steady_ttft_above_reactive_ms"}
    assert "suite" not in doc  # a trace of its own: the unseen traces are the default trace's full run
    assert doc["targets"]["replacement_gap_closed"]["value"] == kv["gap_closed"]
    assert doc["kvwarm"]["plans"] == 7 and doc["kvwarm"]["fallback_plans"] >= 1  # the first minutes: too little history
    assert len(json.loads((tmp_path / "replay_bench.json").read_text())) == 4


def test_tuning_never_uses_the_evaluation_points(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch) -> None:
    monkeypatch.setattr(replay_analysis, "TUNE_GRID", ((0.5, 300.0), (1.0, 120.0)))
    assert replay_bench.main(SMALL + ["--tune", "--results", str(tmp_path)]) == 0
    doc = _last_json(capsys)
    assert doc["mode"] == "tune"
    assert not set(doc["fractions"]) & set(replay_analysis.EVAL_FRACTIONS)
    assert len(doc["grid"]) == 2 and all(len(s["each_ms"]) == 3 * len(doc["fractions"]) for s in doc["grid"])
    best = max(s["ttft_saved_ms"] for s in doc["grid"])
    assert {"retain_fraction": doc["chosen"]["retain_fraction"], "urgent_s": doc["chosen"]["urgent_s"]} in [
        {"retain_fraction": s["retain_fraction"], "urgent_s": s["urgent_s"]} for s in doc["grid"]
        if s["ttft_saved_ms"] == best]


def _row(policy: str, ttft: float, first: float) -> PolicyResult:
    return PolicyResult(policy, 10, 100, 10, 0.1, 0.1, {"gpu": 0.0, "node": 0.1, "s3": 0.0}, first, ttft, ttft, ttft,
                        0.0, None, None, None, (), 0.0)


def test_the_targets_are_issue_25s_against_reactive_store_restore_and_the_oracle() -> None:
    sc = Scenario("replacement", at_s=1.0)
    res = SimResult(sc, (1.0, 601.0), (_row("reactive-store", 0.5, 0.1), _row("kvwarm", 0.4, 0.3),
                                       _row("restore", 0.45, 0.2), _row("oracle", 0.3, 0.4)),
                    {"kvwarm": _row("kvwarm", 0.2, 0.6)})
    ev = replay_analysis.event_figures(res)
    assert ev["kvwarm"]["gap_closed"] == pytest.approx(0.5) and ev["kvwarm"]["first_minute_vs_no_event"] == 0.5
    assert ev["kvwarm"]["ttft_saved_vs_reactive_ms"] == pytest.approx(100.0)
    worse = SimResult(sc, (1.0, 601.0), (_row("reactive-store", 0.5, 0.1), _row("kvwarm", 0.55, 0.1),
                                         _row("restore", 0.45, 0.2), _row("oracle", 0.3, 0.4)),
                      {"kvwarm": _row("kvwarm", 0.2, 0.6)})
    steady = SimResult(Scenario("steady"), (0.0, 1.0), (_row("reactive-store", 0.5, 0.1), _row("kvwarm", 0.49, 0.1)),
                       {})
    events = {f"{k}50": replay_analysis.event_figures(worse if k == "scale-out" else res)
              for k in replay_analysis.EVENTS}
    events["steady"] = replay_analysis.event_figures(steady)
    t = replay_analysis.summarise(events, (0.5,))["targets"]
    assert t["replacement_gap_closed"]["met"] is True and t["scale_out_gap_closed"]["met"] is False
    assert t["replacement_ttft_below_restore_ms"]["value"] == pytest.approx(50.0)
    assert t["scale_out_ttft_below_restore_ms"]["met"] is False  # reported with its sign
    assert t["replacement_first_minute_above_restore_pct"]["value"] == pytest.approx(10.0)
    assert t["replacement_first_minute_vs_oracle"]["value"] == pytest.approx(0.75)
    assert t["replacement_first_minute_vs_oracle"]["met"] is True and t["scale_out_first_minute_vs_oracle"]["met"] is False
    assert t["steady_ttft_above_reactive_ms"]["met"] is True


def test_any_mooncake_format_trace_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A differently shaped trace: short conversations of three turns a minute apart, written as Mooncake JSONL.
    chains, times = [], []
    for c in range(40):
        for turn in range(3):
            chains.append([1] + [1000 * c + k for k in range(2 + turn)])
            times.append(10.0 * c + 60.0 * turn)
    trace = tmp_path / "other.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": int(1000 * t), "input_length": 512 * len(ch),
                                         "output_length": 10, "hash_ids": ch}) + "\n"
                             for t, ch in sorted(zip(times, chains))))
    assert replay_bench.main(["--trace", str(trace), "--quick", "--window", "60", "--cadence", "30",
                              "--out", str(tmp_path), "--results", str(tmp_path)]) == 0
    doc = _last_json(capsys)
    assert doc["requests"] == 120 and doc["kvwarm"]["fallback_plans"] == doc["kvwarm"]["plans"]  # too little history
    assert doc["events"]["replacement50"]["kvwarm"]["warmup_recall"] is not None
