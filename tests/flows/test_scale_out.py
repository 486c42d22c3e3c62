"""Scale-out mining: partitions mined on threads or a real 2-worker Dask cluster give the single-partition demand."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from flows.partitions import Partition, PartitionError, plan_partitions, task_runner
from flows.pipeline import mine_logs
from flows.spec import RunTarget
from flows.tasks import load_demand
from prefill.rundir import RunDir

START, END = "2026-03-02", "2026-03-05"
#: the sample logs' prompts are short: 16-token blocks (the config's default, 256, would find no prefix)
BLOCK = 16


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def partitioned_logs(small_logs, tmp_path_factory) -> Path:
    """The small logs split by day into Hive directories: two days as JSONL, the last as Parquet."""
    root = tmp_path_factory.mktemp("partitioned")
    by_day: dict[str, list[dict]] = {}
    for row in _rows(small_logs):
        day = pd.Timestamp(row["timestamp"], unit="s").strftime("%Y-%m-%d")
        by_day.setdefault(day, []).append(row)
    days = sorted(by_day)
    assert len(days) == 3
    for i, day in enumerate(days):
        d = root / f"date={day}"
        d.mkdir()
        if i < 2:
            (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in by_day[day]))
        else:
            pd.DataFrame(by_day[day]).to_parquet(d / "requests.parquet", index=False)
    return root


@pytest.fixture(scope="module")
def dask_cluster():
    """A real local Dask cluster: two worker processes, one thread each, on loopback, no dashboard."""
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None)
    try:
        yield cluster
    finally:
        cluster.close()


def _assert_same_demand(a: RunDir, b: RunDir) -> None:
    one, other = load_demand(a), load_demand(b)
    assert one.bucket == other.bucket
    for name in ("series", "total", "prefixes", "families"):
        pd.testing.assert_frame_equal(getattr(one, name), getattr(other, name), check_exact=True, obj=name)
    assert len(one.series) and len(one.families)


def test_dask_partitions_mine_exactly_the_single_partition_demand(prefect_harness, small_logs, partitioned_logs,
                                                                  dask_cluster, tmp_path) -> None:
    url = f"file://{tmp_path / 'store'}"
    single = mine_logs(RunTarget(store=url, run="single", block_size=BLOCK), {"logs": small_logs})
    spread = mine_logs(RunTarget(store=url, run="dask", block_size=BLOCK), {"logs": str(partitioned_logs)},
                       {"task_runner": "dask", "dask_address": dask_cluster.scheduler_address})
    assert single == str(RunDir.of(url, "single").demand) and spread == str(RunDir.of(url, "dask").demand)
    _assert_same_demand(RunDir.of(url, "single"), RunDir.of(url, "dask"))

    mined = json.loads(RunDir.of(url, "dask").mine.read_text())
    parts = mined["partitions"]
    assert mined["task_runner"] == "dask" and len(parts) == 3
    assert [Path(p["source"]).parent.name for p in parts] == sorted(Path(p["source"]).parent.name for p in parts)
    assert sum(p["rows_used"] for p in parts) == mined["rows_used"] == len(_rows(small_logs))
    # The tasks ran in the cluster's two worker processes, not in this one.
    workers = {w.worker_address for w in dask_cluster.workers.values()}
    assert {p["worker"].removeprefix("dask:") for p in parts} == workers
    assert len({p["pid"] for p in parts}) == 2 and os.getpid() not in {p["pid"] for p in parts}


def test_time_slices_of_one_file_on_threads_give_the_same_demand_and_quarantine(prefect_harness, small_logs,
                                                                                tmp_path) -> None:
    logs = tmp_path / "logs.jsonl"
    bad = ['{"timestamp": "yesterday", "tenant": "acme", "model": "kvwarm-tiny", "prompt": "x"}', "{not json"]
    logs.write_text(Path(small_logs).read_text() + "\n".join(bad) + "\n")
    url = f"file://{tmp_path / 'store'}"
    mine_logs(RunTarget(store=url, run="whole", block_size=BLOCK), {"logs": str(logs), "start": START, "end": END})
    mine_logs(RunTarget(store=url, run="sliced", block_size=BLOCK),
              {"logs": str(logs), "start": START, "end": END, "slices": 3}, {"parallelism": 3})
    _assert_same_demand(RunDir.of(url, "whole"), RunDir.of(url, "sliced"))
    whole, parts = (json.loads(RunDir.of(url, r).mine.read_text()) for r in ("whole", "sliced"))
    assert [p["kind"] for p in parts["partitions"]] == ["slice"] * 3
    assert parts["read"] == whole["read"].replace(str(RunDir.of(url, "whole").path), str(RunDir.of(url, "sliced").path))
    for run in ("whole", "sliced"):  # each bad row quarantined once, with its reason
        lines = [json.loads(x) for x in RunDir.of(url, run).quarantine.read_text().splitlines()]
        assert sorted(x["reason"] for x in lines) == ["bad_timestamp", "invalid_json"]


def test_partitions_follow_the_read_order_and_skip_hive_days_outside_the_window(partitioned_logs, tmp_path) -> None:
    parts = plan_partitions(str(partitioned_logs))
    assert [p.source.rsplit(".", 1)[1] for p in parts] == ["jsonl", "jsonl", "parquet"]
    assert [p.index for p in parts] == [0, 1, 2]
    later = plan_partitions(str(partitioned_logs), start="2026-03-03T12:00", end="2026-03-04")
    assert [Path(p.source).parent.name for p in later] == ["date=2026-03-03"]
    assert plan_partitions(f"file://{partitioned_logs}")[0].source.startswith("file://")

    one = partitioned_logs / "date=2026-03-02" / "requests.jsonl"
    sl = plan_partitions(str(one), start="2026-03-02", end="2026-03-03", slices=4)
    assert [(p.start, p.end) for p in sl][0][0] == "2026-03-02" and sl[-1].end == "2026-03-03"
    assert all(a.end == b.start for a, b in zip(sl, sl[1:])) and {p.kind for p in sl} == {"slice"}
    assert plan_partitions(str(one)) == [Partition(str(one), None, None, "file", 0)]


@pytest.mark.parametrize("logs, kwargs, match", [
    ("nosuchproto://bucket/logs", {}, "not a path or URL"),
    ("{tmp}/missing", {}, "does not exist"),
    ("{tmp}/notes.txt", {}, "no known log extension"),
    ("{tmp}", {}, "no log files"),
    ("{tmp}/one.jsonl", {"slices": 2}, "needs both start and end"),
    ("{tmp}/one.jsonl", {"slices": 2, "start": "soon", "end": "later"}, "is not a time"),
])
def test_bad_partition_requests_say_what_to_pass(tmp_path, logs, kwargs, match) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "one.jsonl").write_text("")
    if logs == "{tmp}":
        (tmp_path / "one.jsonl").unlink()
    with pytest.raises(PartitionError, match=match):
        plan_partitions(logs.format(tmp=tmp_path), **kwargs)


def test_the_task_runner_is_chosen_by_name() -> None:
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    assert isinstance(task_runner("threads", workers=3), ThreadPoolTaskRunner)
    assert task_runner("dask", address="tcp://127.0.0.1:8786").address == "tcp://127.0.0.1:8786"
    local = task_runner("dask", workers=2)
    assert isinstance(local, DaskTaskRunner) and local.cluster_kwargs["n_workers"] == 2
    with pytest.raises(PartitionError, match="threads, dask"):
        task_runner("ray")
    with pytest.raises(PartitionError, match="only used with"):
        task_runner("threads", address="tcp://127.0.0.1:8786")


def test_tokenising_partitions_apart_builds_the_tree_mining_text_builds(small_logs) -> None:
    import numpy as np

    from forecasting.ingest.logs import read_logs
    from forecasting.mining.prefix_tree import mine_text, tokenize_requests
    from prefill.models import load_model
    from store.config import load_config

    loaded, config = load_model("kvwarm-tiny", device="cpu"), load_config(None)
    requests = read_logs(small_logs).requests
    roots = {t: loaded.key_root(config.kv_cache.precision(), 16, config.tenant(t).salt)
             for t in requests["tenant"].unique()}
    whole = mine_text(requests, loaded.tokenizer, roots)
    cut = len(requests) // 2
    halves = [tokenize_requests(part, loaded.tokenizer, batch_size=7) for part in (requests[:cut], requests[cut:])]
    apart = mine_text(pd.concat(halves, ignore_index=True), None, roots)
    for name in ("times_us", "tenant_codes", "offsets", "path_nodes", "parent", "depth", "count", "seq_values",
                 "seq_offsets"):
        assert np.array_equal(getattr(whole, name), getattr(apart, name)), name
    assert whole.node_keys(range(whole.n_nodes)) == apart.node_keys(range(apart.n_nodes))
