"""A bench run's record (bench.lib.results): where it goes, what it says of its provenance."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

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


def test_paths_beside_the_checkout_become_relative() -> None:
    shared = str(results.ROOT.parent / "shared" / "data" / "t.jsonl")
    assert results.portable({"a": [shared, "/elsewhere/x", 3]}) == {"a": ["../shared/data/t.jsonl", "/elsewhere/x", 3]}


def test_gpu_names_become_short_variants() -> None:
    assert results.gpu_variant("NVIDIA H200") == "h200"
    assert results.gpu_variant("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert results.gpu_variant("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
