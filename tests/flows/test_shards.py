"""The sharded prefill's parent without a server: its report of the shards, its failure message, ``auto``."""
from __future__ import annotations

import json

from flows.shards import failure, shard_count, summarise
from flows.spec import PrefillSpec
from prefill.rundir import RunDir
from prefill.shards import Shard, SharedPrefix


def _shards() -> list[Shard]:
    return [Shard(0, 2, (0, 2), (SharedPrefix(0, 2, 0),), (), 1.0, 64),
            Shard(1, 2, (1, 3), (), (SharedPrefix(0, 2, 0),), 1.1, 48)]


def test_the_report_joins_each_shards_state_and_its_own_result_and_names_the_failed(tmp_path):
    out = RunDir.of(f"file://{tmp_path}", "r")
    out.path.mkdir(parents=True)
    out.shard_result(0).write_text(json.dumps({"flow_run": "a", "tokens_computed": 64, "forward_tokens": 80,
                                               "blocks_written": 4, "blocks_left": 0, "seconds": 2.0, "cut": [],
                                               "stopped": None}))
    # a stale file of an earlier run of shard 1 is not this run's result
    out.shard_result(1).write_text(json.dumps({"flow_run": "old", "tokens_computed": 999, "cut": [3]}))
    summary = summarise(out, _shards(), ["a", "b"], [{"state": "COMPLETED", "message": ""},
                                                     {"state": "CRASHED", "message": "exit code -9"}])
    assert summary["tokens_computed"] == 64 and summary["blocks_written"] == 4 and summary["cut"] == []
    assert summary["tokens_per_s"] == 32.0 and summary["failed"] == [1]
    assert list(summary["shards"][1]["assignment"]["waits"]) == [{"entry": 0, "blocks": 2, "owner": 0}]
    assert summary["balance"]["max_over_mean"] > 1.0
    message = str(failure(summary))
    assert "shard 1/2 (flow run b) ended CRASHED: exit code -9" in message and "shard 0/2" not in message
    assert "only the missing ones are computed" in message


def test_auto_is_one_shard_without_a_server(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr("flows.shards.get_run_logger", lambda: __import__("logging").getLogger("t"))
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert shard_count(PrefillSpec(shards="auto")) == 1
    assert shard_count(PrefillSpec(shards=3)) == 3
