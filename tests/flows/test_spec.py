"""The run spec: one frozen, validated model of every flow knob; bad values are refused with the field named."""
from __future__ import annotations

import pydantic
import pytest

from flows.spec import MiningSpec, PlanSpec, RunnerSpec, RunSpec, RunTarget

STORE = "file:///tmp/kvwarm-spec"


def spec(**sections) -> dict:
    return {"target": {"store": STORE, "run": "r"}, "mining": {"logs": "logs.jsonl"}, **sections}


def test_the_defaults_are_the_documented_ones_and_the_spec_is_frozen() -> None:
    s = RunSpec.model_validate(spec())
    assert (s.target.model, s.target.block_size, s.target.config_path) == ("kvwarm-tiny", None, None)
    assert (s.mining.bucket, s.mining.k, s.mining.slices, s.mining.similarity) == ("1h", 3, 1, None)
    assert (s.runner.task_runner, s.runner.parallelism) == ("threads", 2)
    assert (s.forecast.horizon, s.forecast.workers, s.forecast.window_hours, s.forecast.offpeak_fraction) == (
        24, 1, 3.0, 0.6)
    assert (s.plan.budget_gpu_s, s.plan.budget_store_bytes, s.plan.gpu_s_per_gib_hour) == (3600.0, 2.0 ** 30, 0.5)
    assert (s.prefill.device, s.prefill.dtype) == ("cpu", "fp32")
    assert s.stages.prefill and s.stages.gc and s.monitoring.gpu_price_per_hour is None
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        s.mining.k = 5  # type: ignore[misc]
    assert RunSpec.model_validate(s.model_dump(mode="json")) == s  # what a deployment stores reads back equal


@pytest.mark.parametrize("sections, field, message", [
    ({"mining": {"logs": "l", "bucket": "banana"}}, "mining.bucket", "not a positive duration"),
    ({"mining": {"logs": "l", "bucket": "-1h"}}, "mining.bucket", "not a positive duration"),
    ({"mining": {"logs": "l", "end": "yesterday"}}, "mining.end", "'yesterday' is not a time"),
    ({"mining": {"logs": "l", "start": "2026-03-04", "end": "2026-03-02"}}, "mining", "is not before end"),
    ({"mining": {"logs": "l", "similarity": 0.2}}, "mining.similarity", "greater than or equal to 0.5"),
    ({"mining": {"logs": ""}}, "mining.logs", "at least 1 character"),
    ({"runner": {"task_runner": "ray"}}, "runner.task_runner", "'threads' or 'dask'"),
    ({"runner": {"dask_address": "tcp://s:8786"}}, "runner", "only used with task_runner 'dask'"),
    ({"forecast": {"offpeak_fraction": 1.5}}, "forecast.offpeak_fraction", "less than or equal to 1"),
    ({"plan": {"budget_gpu_s": -1}}, "plan.budget_gpu_s", "greater than or equal to 0"),
    ({"plan": {"schedule_prefill": "prefill-offpeak"}, "stages": {"prefill": False}}, "plan.schedule_prefill",
     "FLOW/DEPLOYMENT"),
    ({"plan": {"schedule_prefill": "prefill-plan/prefill-offpeak"}}, "", "set stages.prefill to false"),
    ({"prefill": {"dtype": "int4"}}, "prefill.dtype", "'fp32', 'bf16' or 'fp16'"),
    ({"prefill": {"device": "cuda 0"}}, "prefill.device", "should match pattern"),
    ({"target": {"store": STORE, "run": "../escape"}}, "target", "without '/'"),
    ({"target": {"store": "s3://bucket/p", "run": "r"}}, "target", "no local tier first"),
    ({"target": {"store": STORE, "block_size": 0}}, "target.block_size", "greater than or equal to 1"),
    ({"forecast": {"horizon": 24, "horizn": 48}}, "forecast.horizn", "Extra inputs are not permitted"),
])
def test_a_bad_value_is_refused_with_the_field_named(sections, field, message) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        RunSpec.model_validate(spec(**sections))
    errors = info.value.errors()
    assert [".".join(map(str, e["loc"])) for e in errors] == [field]
    assert message in errors[0]["msg"]


def test_a_target_may_name_no_run_and_is_given_one_checked() -> None:
    store_only = RunTarget(store="s3://bucket/prefix")  # GC of a whole store needs no run, nor a local tier
    assert store_only.run is None
    named = RunTarget(store=STORE).with_run("run-1")
    assert named.run == "run-1" and named.store == STORE
    with pytest.raises(pydantic.ValidationError, match="no local tier first"):
        store_only.with_run("run-1")


def test_the_sections_are_usable_alone() -> None:
    assert MiningSpec(logs="s3://logs/", start="2026-03-01", end="2026-03-02").end == "2026-03-02"
    assert RunnerSpec(task_runner="dask", dask_address="tcp://s:8786").parallelism == 2
    assert PlanSpec(schedule_prefill="prefill-plan/prefill-offpeak").schedule_prefill == "prefill-plan/prefill-offpeak"
