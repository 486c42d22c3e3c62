"""docs/benchmarks.md is what bench/report.py makes from bench/results/, and a bad record cannot break it."""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest

from bench import report
from bench.lib.results import RESULTS


def test_the_page_is_what_the_committed_records_make() -> None:
    # A record changed without regenerating the page (or the page edited by hand) fails here:
    # run `.venv/bin/python bench/report.py`.
    assert report.PAGE.read_text() == report.render(RESULTS)


def test_the_page_stays_one_page() -> None:
    # one page: 220 before LMCache side by side (engine, live replay), 260 before the node process's five parts,
    # 340 before the write-back and miss-path benches on a real engine
    assert len(report.PAGE.read_text().splitlines()) < 400


def test_every_bench_has_a_record_or_says_what_to_run(tmp_path: Path) -> None:
    page = report.render(tmp_path)  # no records at all
    for bench, _, _ in report.CPU_SECTIONS:
        assert f"_No record in `bench/results/{bench}.json` yet: run `.venv/bin/python {report.script_of(bench)}`" in page
    assert "_No record in `bench/results/loader-h200.json` yet: run `bash bench/gpu_check.sh`" in page


def test_a_partial_or_unreadable_record_gives_a_clear_line(tmp_path: Path) -> None:
    full = json.loads((RESULTS / "loader-h200.json").read_text())
    del full["result"]["ttft"]
    (tmp_path / "loader-h200.json").write_text(json.dumps(full))
    (tmp_path / "prefill-h200.json").write_text('{"bench": "prefill", "result": ')
    page = report.render(tmp_path)
    assert "_`bench/results/loader-h200.json` lacks figures this page shows (KeyError: 'ttft'): rerun " in page
    assert "_`bench/results/prefill-h200.json` is not a readable record (" in page


def test_a_quick_record_is_shown_only_without_a_full_one_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "store-quick.json").write_text("{}")
    shutil.copy(RESULTS / "prefill-h200.json", tmp_path / "prefill-h200.json")
    page = report.render(tmp_path)
    assert "_From a quick run (`bench/results/store-quick.json`)" in page
    assert "_`bench/results/store-quick.json` lacks figures this page shows (KeyError: 'sizes_mib')" in page
    assert "7,991 tok/s (0.234)" in page  # the H200 prefill record, labelled with how it was made
    assert "Recorded on an H200 by bench/gpu_check.sh: `bench/prefill_bench.py --shape 8b" in page
    assert "Commit `fa31ebf`, 2026-11-29" in page


def test_every_record_parses_and_names_the_command_that_made_it() -> None:
    records = sorted(RESULTS.glob("*.json"))
    assert records
    for path in records:
        rec = json.loads(path.read_text())
        assert isinstance(rec.get("result"), dict), f"{path.name}: no result (write it with bench.lib.results.Run)"
        script, *_ = rec["command"].split()
        assert script.startswith("bench/") and (report.ROOT / script).is_file(), f"{path.name}: {rec['command']}"
        assert rec["commit"] and rec["date"] and rec["machine"]["cpus"], path.name


class _Parsed(Exception):
    """Raised in place of a bench's run, once its parser has accepted the command line."""


def _parse(script: Path, argv: list[str]) -> argparse.Namespace:
    spec = importlib.util.spec_from_file_location(f"_bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    with mock.patch.dict(sys.modules, {spec.name: module}):  # its dataclasses look their module up
        spec.loader.exec_module(module)
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), pytest.raises(_Parsed) as got:
            module.main(argv)
    return got.value.args[0]


def test_every_command_on_the_page_is_one_its_bench_accepts() -> None:
    # the page shows each record's command to rerun: an option renamed since would fail it
    for path in sorted(RESULTS.glob("*.json")):
        script, *argv = shlex.split(json.loads(path.read_text())["command"])
        assert isinstance(_parse(report.ROOT / script, argv), argparse.Namespace), path.name


def _record(bench: str, result: dict, **extra) -> dict:
    return {"bench": bench, "variant": None, "command": f"bench/{bench}_bench.py --fast", "commit": "abc1234",
            "dirty": False, "date": "2026-12-02 00:00 UTC", "duration_s": 12.0, "loadavg": [1.0, 1.0],
            "machine": {"cpus": 2, "cpu_model": None, "torch": "2.13.0+cpu", "gpu": None}, "result": result, **extra}


def test_a_record_no_page_knows_yet_gets_a_section_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "newthing.json").write_text(json.dumps(_record(
        "newthing", {"bench": "newthing", "ttft_s": {"warm": 0.25, "cold": 1.5}, "loads": 3, "each": [1, 2],
                     "targets": {"warm_over_cold_met": False, "ratio": {"value": 0.17, "target": 0.2, "met": True}}})))
    (tmp_path / "newthing-quick.json").write_text("{}")
    (tmp_path / "raw-gpu.json").write_text(json.dumps({"bench": "raw", "device": "cuda", "load_s": 0.5}))
    page = report.render(tmp_path)
    new = page[page.index("## Newthing (bench/newthing_bench.py)"):page.index("## GPU (H200)")]
    assert "Command: `.venv/bin/python bench/newthing_bench.py --fast` (12 s). Commit `abc1234`" in new
    assert "| `ttft_s.warm` | 0.25 |" in new and "| `loads` | 3 |" in new and "each" not in new
    assert "| warm_over_cold_met |  |  | **not met** |" in new and "| ratio | 0.17 | 0.2 | met |" in new
    assert "Also recorded, not shown (not the targets' measure): `bench/results/newthing-quick.json`." in new
    gpu = page[page.index("## GPU (H200)"):]
    assert "### Raw, gpu (bench/raw_bench.py)" in gpu and "| `load_s` | 0.5 |" in gpu
    assert "_`bench/results/raw-gpu.json` holds figures but not how they were made" in gpu


def test_a_record_says_how_busy_the_machine_was_and_flags_a_busy_one(tmp_path: Path) -> None:
    quiet = report.load(_record("x", {}, load={"median": 1.5, "max": 3.0, "samples": 40, "every_s": 10, "nice": 5}))
    assert quiet == ", load average 1.5 (median of 40 samples, max 3.0), run at nice 5."
    busy = report.load(_record("x", {}, load={"median": 4.5, "max": 9.0, "samples": 40, "every_s": 10, "nice": 0}))
    assert busy.startswith(", load average 4.5 (median of 40 samples, max 9.0).") and "was busy" in busy
    assert "was busy" not in report.load(_record("x", {}, loadavg=[3.9, 1.0]))
    assert "was busy" in report.load(_record("x", {}, loadavg=[4.1, 1.0]))


def test_make_bench_runs_each_bench_as_the_page_shows_it() -> None:
    recipe = report.ROOT.joinpath("Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    commands = [line.strip().removeprefix("$(PY) ") for line in recipe.splitlines()[1:]]
    assert commands[-1] == "bench/report.py"
    for bench, variant, _ in report.CPU_SECTIONS:
        path = RESULTS / f"{bench}.json"
        if path.exists():
            assert json.loads(path.read_text())["command"] in commands, bench
