"""Flows that fail end FAILED with a reason a person can act on; a rerun resumes without redoing work.

Bad input (a malformed logs path, logs where every row is bad, a bad config value or
parameter), an S3 tier whose endpoint is down (a closed port on 127.0.0.1), and a
prefill that dies after some blocks (a write failure injected into the store) then is
rerun.
"""
from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from flows.pipeline import forecast_demand, gc_store, kvwarm_pipeline, mine_logs, plan_prewarm, prefill_plan
from flows.spec import RunTarget
from flows.tasks import StoreUnreachable
from prefill.rundir import RunDir
from store.plan import read_plan
from store.tiers.base import SUFFIX
from store.tiers.store import Store

KEY_ENV, SECRET_ENV = "KVWARM_FLOW_TEST_KEY", "KVWARM_FLOW_TEST_SECRET"
#: the sample logs' prompts are short: 16-token blocks (the config's default, 256, would find no prefix)
BLOCK = 16


def _snapshots(store: Path) -> list[Path]:
    return [p for p in store.rglob(f"*{SUFFIX}") if "_flows" not in p.parts]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def planned(prefect_harness, small_logs, tmp_path_factory) -> tuple[Path, str]:
    """A run mined, forecast and planned (nothing prefilled yet)."""
    store = tmp_path_factory.mktemp("store")
    url = f"file://{store}"
    target = RunTarget(store=url, run="f", block_size=BLOCK)
    mine_logs(target, {"logs": small_logs, "end": "2026-03-04"})
    forecast_demand(target)
    plan_prewarm(target)
    return store, url


def _failed(state) -> str:
    assert state.is_failed(), state
    return state.message


# -- bad input ------------------------------------------------------------------------------

def test_a_malformed_logs_path_fails_mining_with_the_reason(prefect_harness, tmp_path) -> None:
    state = mine_logs(RunTarget(store=f"file://{tmp_path}", run="bad"), {"logs": "nosuchproto://bucket/logs"},
                      return_state=True)
    message = _failed(state)
    assert "nosuchproto://bucket/logs" in message and "not a path or URL" in message


def test_logs_whose_every_row_is_bad_fail_with_the_counts_and_the_quarantine_file(prefect_harness, tmp_path) -> None:
    logs = tmp_path / "bad.jsonl"
    logs.write_text('{"timestamp": 1, "tenant": "acme"}\nnot json\n[1, 2]\n')
    state = mine_logs(RunTarget(store=f"file://{tmp_path / 'store'}", run="allbad"), {"logs": str(logs)},
                      return_state=True)
    message = _failed(state)
    quarantine = RunDir.of(f"file://{tmp_path / 'store'}", "allbad").quarantine
    assert "no usable request" in message and "quarantined 3" in message and str(quarantine) in message
    reasons = sorted(json.loads(line)["reason"] for line in quarantine.read_text().splitlines())
    assert reasons == ["bad_model", "invalid_json", "not_an_object"]  # nothing lost


def test_a_bad_config_value_fails_the_pipeline_naming_the_key(prefect_harness, small_logs, tmp_path) -> None:
    config = tmp_path / "kvwarm.yaml"
    config.write_text("kv_cache:\n  compression: fp4\n")
    state = kvwarm_pipeline({"target": {"store": f"file://{tmp_path / 'store'}", "run": "badcfg",
                                        "config_path": str(config)}, "mining": {"logs": small_logs}},
                            return_state=True)
    message = _failed(state)
    assert "kv_cache.compression" in message and "fp4" in message and str(config) in message


@pytest.mark.parametrize("target, mining, runner, match", [
    ({"block_size": 0}, {}, {}, "target.block_size: Input should be greater than or equal to 1"),
    ({}, {"bucket": "banana"}, {}, "mining.bucket: Value error, bucket 'banana' is not a positive duration"),
    ({}, {}, {"task_runner": "ray"}, "runner.task_runner: Input should be 'threads' or 'dask'"),
    ({}, {"bukcet": "1h"}, {}, "mining.bukcet: Extra inputs are not permitted"),
])
def test_a_bad_parameter_fails_mining_before_any_work(prefect_harness, small_logs, tmp_path, target, mining, runner,
                                                      match) -> None:
    url = f"file://{tmp_path}"
    state = mine_logs({"store": url, "run": "p", **target}, {"logs": small_logs, **mining}, runner,
                      return_state=True)
    assert match in _failed(state)
    assert not RunDir.of(url, "p").demand.exists()


def test_a_deadline_already_past_fails_prefill_without_writing(planned) -> None:
    store, url = planned
    before = len(_snapshots(store))
    message = _failed(prefill_plan(RunTarget(store=url, run="f", block_size=BLOCK), deadline=1.0, return_state=True))
    assert "deadline" in message and "already past" in message
    assert len(_snapshots(store)) == before


# -- S3 down --------------------------------------------------------------------------------

@pytest.fixture
def s3_down(tmp_path, monkeypatch) -> tuple[str, int]:
    """A config whose S3 endpoint is a closed port on loopback (short timeouts, no botocore retries)."""
    monkeypatch.setenv(KEY_ENV, "test")
    monkeypatch.setenv(SECRET_ENV, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = _closed_port()
    config = tmp_path / "down.yaml"
    config.write_text(f"store:\n  s3:\n    endpoint_url: http://127.0.0.1:{port}\n    access_key_env: {KEY_ENV}\n"
                      f"    secret_key_env: {SECRET_ENV}\n    connect_timeout_s: 1\n    read_timeout_s: 1\n"
                      f"    op_timeout_s: 5\n    retries: 0\n")
    return str(config), port


def _copy_run(planned, tmp_path) -> str:
    """The planned run under a fresh local tier (so a failed run here leaves the shared one untouched)."""
    _, url = planned
    fresh = f"file://{tmp_path / 'node'}"
    shutil.copytree(RunDir.of(url, "f").path, RunDir.of(fresh, "f").path)
    return fresh


def _task_runs(state) -> dict[str, int]:
    """Task name -> run count (attempts) of the flow run behind ``state``."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.run_count for r in runs}


def test_prefill_with_s3_down_fails_after_its_retries_saying_s3_is_unreachable(planned, s3_down, tmp_path) -> None:
    url = _copy_run(planned, tmp_path)
    config, port = s3_down
    state = prefill_plan(RunTarget(store=f"{url},s3://kvwarm-down/p", run="f", config_path=config,
                                   block_size=BLOCK), return_state=True)
    message = _failed(state)
    assert "S3 is unreachable (prefill)" in message and f"127.0.0.1:{port}" in message
    assert "Traceback" not in message and len(message) < 2000
    with pytest.raises(StoreUnreachable):
        state.result()
    assert _task_runs(state)["prefill_task"] == 2  # the first attempt and its retry


def test_gc_with_s3_down_fails_saying_s3_is_unreachable(planned, s3_down, tmp_path) -> None:
    url = _copy_run(planned, tmp_path)
    config, port = s3_down
    message = _failed(gc_store(RunTarget(store=f"{url},s3://kvwarm-down/p", config_path=config), return_state=True))
    assert "S3 is unreachable (gc)" in message and f"127.0.0.1:{port}" in message


# -- resume ---------------------------------------------------------------------------------

def test_a_prefill_that_died_midway_resumes_writing_only_the_missing_blocks(planned, monkeypatch) -> None:
    store, url = planned
    assert read_plan(RunDir.of(url, "f").plan).entries
    real_put, written = Store.put, []

    def put_then_die(self, tenant, snap):
        if len(written) == 2:
            raise OSError("injected: the disk went away")
        if real_put(self, tenant, snap):
            written.append(snap.key)
        return True

    before = len(_snapshots(store))
    monkeypatch.setattr(Store, "put", put_then_die)
    message = _failed(prefill_plan(RunTarget(store=url, run="f", block_size=BLOCK), return_state=True))
    assert "the disk went away" in message
    assert len(written) == 2 and len(_snapshots(store)) == before + 2

    monkeypatch.setattr(Store, "put", real_put)
    report = prefill_plan(RunTarget(store=url, run="f", block_size=BLOCK))
    assert report["blocks_stored_before"] == 2
    assert report["blocks_written"] == report["blocks_total"] - 2 > 0
    assert len(_snapshots(store)) == before + report["blocks_total"]
    assert json.loads(RunDir.of(url, "f").prefill.read_text()) == report
