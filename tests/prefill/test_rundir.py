"""The run directory: one name for every file a run keeps, under the store's local tier."""
from __future__ import annotations

from pathlib import Path

import pytest

from prefill.rundir import DEMAND_TABLES, RESULTS, RunDir, RunDirError


def test_a_run_lives_under_the_first_local_tier_of_the_store(tmp_path) -> None:
    run = RunDir.of(f"file://{tmp_path},s3://bucket/prefix", "nightly")
    assert run.path == tmp_path.resolve() / "_flows" / "nightly" and run.name == "nightly"
    assert RunDir.of("file://~/kv", "r").path == Path("~/kv").expanduser().resolve() / "_flows" / "r"


def test_every_file_has_one_name_inside_the_run() -> None:
    run = RunDir(Path("/srv/kv/_flows/r"))
    files = {run.mine, run.quarantine, run.forecast, run.total_forecast, run.window, run.plan, run.prefill, run.gc,
             run.audit, run.report, run.forecast_plot, run.offpeak_plot, run.replay_outcomes, run.hitrate_plot,
             run.demand_meta, *(run.demand_table(t) for t in DEMAND_TABLES)}
    assert len(files) == 15 + len(DEMAND_TABLES)  # no two share a path
    assert all(f.is_relative_to(run.path) for f in files)
    assert [run.result(s).name for s in RESULTS] == ["mine.json", "plan.json", "prefill.json", "gc.json",
                                                     "audit.json", "report.json"]
    assert (run.plan, run.demand_table("series")) == (run.path / "plan.json", run.path / "demand" / "series.parquet")
    with pytest.raises(ValueError, match="no stage 'window'.*mine, plan, prefill, gc, audit, report"):
        run.result("window")
    with pytest.raises(ValueError, match="no demand table 'counts'"):
        run.demand_table("counts")


@pytest.mark.parametrize("url, run, message", [
    ("s3://bucket/prefix", "r", "no local tier first"),
    ("file:///tmp/x", "../up", "without '/'"),
    ("file:///tmp/x", ".hidden", "without '/'"),
    ("file:///tmp/x", "", "non-empty"),
])
def test_bad_store_urls_and_run_names_are_refused(url, run, message) -> None:
    with pytest.raises(RunDirError, match=message):
        RunDir.of(url, run)


def test_the_other_runs_of_a_store_are_its_sibling_directories(tmp_path) -> None:
    url = f"file://{tmp_path}"
    assert RunDir.of(url, "first").others() == []  # no run yet: no _flows folder
    for name in ("monday", "tuesday"):
        RunDir.of(url, name).path.mkdir(parents=True)
    (tmp_path / "_flows" / "stray.txt").write_text("not a run")
    tuesday = RunDir.of(url, "tuesday")
    assert tuesday.others() == [RunDir.of(url, "monday")]
    assert tuesday.loader_stats_files() == []
    tuesday.loader_stats.mkdir()
    for name in ("b", "a"):
        (tuesday.loader_stats / f"{name}.json").write_text("{}")
    assert [p.name for p in tuesday.loader_stats_files()] == ["a.json", "b.json"]
