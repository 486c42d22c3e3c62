"""docs/benchmarks.md is what bench/report.py makes from bench/results/, and a bad record cannot break it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench import report
from bench.lib.results import RESULTS


def test_the_page_is_what_the_committed_records_make() -> None:
    # A record changed without regenerating the page (or the page edited by hand) fails here:
    # run `.venv/bin/python bench/report.py`.
    assert report.PAGE.read_text() == report.render(RESULTS)


def test_the_page_stays_one_page() -> None:
    assert len(report.PAGE.read_text().splitlines()) < 200


def test_every_bench_has_a_record_or_says_what_to_run(tmp_path: Path) -> None:
    page = report.render(tmp_path)  # no records at all
    for bench, _, _ in report.CPU_SECTIONS:
        assert f"_No record in `bench/results/{bench}.json` yet: run `.venv/bin/python bench/{bench}_bench.py`" in page
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
    assert "_`bench/results/store-quick.json` lacks figures this page shows (KeyError: 'machine')" in page
    assert "7,991 tok/s (0.234)" in page  # the H200 prefill record, labelled with how it was made
    assert "Recorded on an H200 by bench/gpu_check.sh: `bench/prefill_bench.py --shape 8b" in page
    assert "Commit `fa31ebf`, 2026-11-29" in page
