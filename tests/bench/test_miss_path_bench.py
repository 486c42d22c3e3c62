"""The miss-path bench's figures from its engines' results (bench/miss_path_bench.py), and its page section.

The bench itself drives vLLM for minutes (the Makefile's rule test covers its last line); these are its pure parts.
"""
from __future__ import annotations

import importlib.util

import pytest

from bench.lib.component_pages import PAGES
from bench.lib.results import ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("miss_path_bench", ROOT / "bench" / "miss_path_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _engine(rounds: list[tuple[str, list[float]]], final: dict | None = None, node: dict | None = None) -> dict:
    """A driver result with these rounds (mode, TTFTs), its phases joined from them."""
    phases: dict = {}
    for mode, ttft in rounds:
        phases.setdefault(mode, {"ttft_s": []})["ttft_s"] += ttft
    return {"rounds": [{"mode": m, "ttft_s": t} for m, t in rounds], "phases": phases, "node_connect_s": 0.5,
            "final_stats": final or {}, "stats": {"scheduler": {"node": node}} if node else {}}


def _two_modes(seq: list[float], conc: list[float], **kw) -> dict:
    return _engine([("sequential", seq), ("concurrent", conc)], **kw)


def test_each_mode_pools_its_rounds_and_divides_kvwarm_by_vllm_pooled_and_round_by_round(bench) -> None:
    runs = {"vllm": _engine([("sequential", [1.0, 1.0, 1.0]), ("concurrent", [2.0, 2.0]), ("sequential", [3.0]),
                             ("concurrent", [4.0, 4.0])]),
            "kvwarm": _engine([("sequential", [1.1, 1.2, 1.2]), ("concurrent", [2.0, 2.0]), ("sequential", [3.3]),
                               ("concurrent", [2.0, 6.0])])}
    out = bench.summarize(runs)
    seq = out["sequential"]
    assert seq["vllm"]["n"] == 4 and seq["vllm"]["median_ms"] == pytest.approx(1000.0)
    assert seq["kvwarm"]["median_ms"] == pytest.approx(1200.0)
    assert seq["ratio_median"] == pytest.approx(1.2) and seq["ratio_mean"] == pytest.approx(6.8 / 6.0)
    assert seq["per_round_ratio_median"] == pytest.approx([1.2, 1.1])
    assert seq["paired_ratio_median"] == pytest.approx(1.15)
    conc = out["concurrent"]
    assert conc["ratio_mean"] == pytest.approx(1.0) and conc["kvwarm"]["max_ms"] == pytest.approx(6000.0)
    assert conc["per_round_ratio_median"] == pytest.approx([1.0, 1.0])


def test_the_rounds_alternate_the_modes_each_prompt_its_own(bench) -> None:
    plan = bench.rounds(10, 4, 16, 100)
    assert [(r["mode"], r["concurrency"], len(r["prompts"])) for r in plan] == [
        ("sequential", 1, 4), ("concurrent", 4, 4), ("sequential", 1, 4), ("concurrent", 4, 4),
        ("sequential", 1, 2), ("concurrent", 4, 2)]
    every = [tuple(p) for r in plan for p in r["prompts"]]
    assert len(set(every)) == len(every) == 20 and all(len(p) == 16 for p in every)


def test_kvwarms_counters_sum_the_workers_write_back_the_schedulers_lookups_and_the_nodes(bench) -> None:
    one = _two_modes([1.0], [1.0], final={"worker": {"written_back_blocks": 8, "write_back_dropped:queue_full": 2,
                                                  "upload_dropped:evicted": 1, "loads": 0, "stats_note": "x"},
                                       "scheduler": {"lookups": 4, "misses:absent": 4, "written_back_blocks": 6}},
                  node={"connected": True, "fallbacks": 1, "fleet_records": 4})
    two = _two_modes([1.0], [1.0], final={"worker": {"written_back_blocks": 8}, "scheduler": {"lookups": 4}},
                  node={"connected": False, "fallbacks": 0, "fleet_records": 3})
    c = bench.counters([one, two])
    assert c["written_back_blocks"] == 16  # the worker's own count, not the scheduler's copy of it
    assert c["write_back_dropped:queue_full"] == 2 and c["upload_dropped:evicted"] == 1
    assert c["lookups"] == 8 and c["misses:absent"] == 4 and "loads" not in c
    assert c["node"] == {"connected": [True, False], "fallbacks": 1, "fleet_records": 7}


def test_the_page_shows_both_modes_their_ratios_and_verdicts(bench) -> None:
    runs = {"vllm": _two_modes([1.0, 1.0], [2.0, 2.0]), "kvwarm": _two_modes([1.05, 1.05], [2.6, 2.6], node={
        "connected": True, "fallbacks": 0, "fleet_records": 2})}
    figures = bench.summarize(runs)
    record = {"prompt_tokens": 2048, "concurrency": 4, "requests_per_mode": 2, "round": 2, "rounds": 2, "warmup": 1,
              "max_tokens": 8, "kvwarm_drain_s": 0.4, **figures, "kvwarm_counters": bench.counters([runs["kvwarm"]]),
              "targets": {f"ttft_{m}_{s}_ratio_le_1.1": {"value": figures[m][f"ratio_{s}"], "target": 1.1,
                                                         "met": figures[m][f"ratio_{s}"] <= 1.1}
                          for m in bench.MODES for s in ("median", "mean")}}
    (table,) = PAGES["miss_path"].tables(record)
    rows = {r[0]: r for r in table.rows}
    assert rows["one at a time: kvwarm ÷ vLLM"][1:] == ("**1.050**", "**1.050**", "", "1.050", "met / met")
    assert rows["4 in flight: kvwarm ÷ vLLM"][5] == "**not met** / **not met**"
    assert rows["4 in flight: vLLM alone"][1] == "2,000 ms"
    assert "dropped none" in table.note and "connected while serving: yes" in table.note


def test_settings_given_on_the_command_line_lie_over_the_shipped_defaults(bench, tmp_path) -> None:
    import yaml

    from store.config import load_config

    extra = bench.overrides(["loader.write_back_via=node", "node.autostart_idle_s=60", "fleet_memory.enabled=false"])
    assert extra == {"loader": {"write_back_via": "node"}, "node": {"autostart_idle_s": 60},
                     "fleet_memory": {"enabled": False}}
    path = bench.kvwarm_config(tmp_path / "k.yaml", endpoint="http://127.0.0.1:1", sock=tmp_path / "n.sock",
                               extra=extra)
    raw = yaml.safe_load(path.read_text())
    assert raw["node"]["socket"] == str(tmp_path / "n.sock") and raw["loader"]["pool_dir"]  # kept beside the new
    cfg = load_config(path)
    assert cfg.loader.write_back_via == "node" and not cfg.fleet_memory.enabled and cfg.node.autostart_idle_s == 60
    with pytest.raises(SystemExit, match="SECTION.KEY=VALUE"):
        bench.overrides(["write_back_via=node"])


def test_a_process_cpu_seconds_are_read_from_proc(bench) -> None:
    import os

    assert bench.cpu_seconds(os.getpid()) > 0 and bench.cpu_seconds(2 ** 22 + 7) is None
