"""A bench run's record (bench.lib.results): where it goes, what it says of its provenance."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from bench.lib import results


def _args(*argv: str, quick: bool = False) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    results.add_results_option(ap)
    return ap.parse_args([*argv, *(["--quick"] if quick else [])])


def test_a_quick_partial_or_gpu_run_never_takes_the_full_runs_file(tmp_path: Path) -> None:
    assert results.variant_of(_args()) is None
    assert results.variant_of(_args(quick=True)) == "quick"
    assert results.variant_of(_args(), partial=True) == "partial"
    assert results.variant_of(_args(quick=True), partial=True) == "quick"
    assert results.variant_of(_args(), gpu="NVIDIA H200") == "h200"
    assert results.variant_of(_args(quick=True), gpu="NVIDIA H200") == "h200-quick"
    assert results.variant_of(_args("--variant", "mine", quick=True)) == "mine"
    assert results.result_path(tmp_path, "store", None) == tmp_path / "store.json"
    assert results.result_path(tmp_path, "store", "quick") == tmp_path / "store-quick.json"


def test_the_record_holds_the_result_and_how_it_was_made(tmp_path: Path) -> None:
    here = str(results.ROOT / "tests" / "data" / "x.jsonl")
    run = results.Run("replay", str(results.ROOT / "bench" / "replay_bench.py"),
                      ["--trace", here, "--results", str(tmp_path), "--quick"])
    path = run.write({"bench": "replay", "trace": here, "figures": [1, 2]}, tmp_path, "quick")
    record = json.loads(path.read_text())
    assert path == tmp_path / "replay-quick.json"
    # no absolute path of this checkout, and not where the record went: only how it was made
    assert record["command"] == "bench/replay_bench.py --trace tests/data/x.jsonl --quick"
    assert record["result"] == {"bench": "replay", "trace": "tests/data/x.jsonl", "figures": [1, 2]}
    assert record["bench"] == "replay" and record["variant"] == "quick"
    assert len(record["commit"]) >= 7 and isinstance(record["dirty"], bool)
    assert record["machine"]["cpus"] >= 1 and record["machine"]["torch"]
    assert record["date"].endswith("UTC") and record["duration_s"] >= 0
    # how busy the shared machine was: sampled through the run (here only its two ends), and the niceness
    load = record["load"]
    assert load["samples"] == 2 and load["max"] >= load["median"] >= 0 and load["nice"] == os.nice(0)


def test_finish_writes_the_record_then_prints_the_result_as_the_last_line(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = results.Run("mining", str(results.ROOT / "bench" / "mining_bench.py"), ["--quick"])
    result = {"bench": "mining", "note": "two\nlines", "figures": [1.5, None]}
    path = run.finish(result, tmp_path, "quick")
    out, err = capsys.readouterr()
    assert out.endswith("\n") and not err
    lines = out.splitlines()
    # what `tail -1 | jq` reads: the object itself, on one line, after the line saying where it went
    assert json.loads(lines[-1]) == result
    assert lines[-2] == f"result written to {results.portable(str(path.resolve()))}"
    assert json.loads(path.read_text())["result"] == result


def test_a_last_line_is_one_json_object_on_one_line() -> None:
    line = results.last_line({"a": "x\ny", "b": {"c": [1, 2]}})
    assert "\n" not in line and json.loads(line) == {"a": "x\ny", "b": {"c": [1, 2]}}
    with pytest.raises(TypeError, match="JSON object"):
        results.last_line([1, 2])  # type: ignore[arg-type]


def test_paths_beside_the_checkout_become_relative() -> None:
    shared = str(results.ROOT.parent / "shared" / "data" / "t.jsonl")
    assert results.portable({"a": [shared, "/elsewhere/x", 3]}) == {"a": ["../shared/data/t.jsonl", "/elsewhere/x", 3]}


def test_gpu_names_become_short_variants() -> None:
    assert results.gpu_variant("NVIDIA H200") == "h200"
    assert results.gpu_variant("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert results.gpu_variant("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
