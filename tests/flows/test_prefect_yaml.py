"""prefect.yaml checked without a server: entrypoints load, schedules parse, parameters fit the flows' run spec."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = yaml.safe_load((ROOT / "prefect.yaml").read_text())
DEPLOYMENTS = DOC["deployments"]


def test_the_stages_the_issue_names_are_scheduled():
    names = {d["name"] for d in DEPLOYMENTS}
    assert {"mine-hourly", "forecast-hourly", "plan-hourly", "plan-5min", "prefill-offpeak", "gc-15min"} <= names
    pools = {d["work_pool"]["name"] for d in DEPLOYMENTS}
    assert pools == {"kvwarm-cpu", "kvwarm-gpu"}


@pytest.mark.parametrize("dep", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_entrypoint_loads_and_parameters_match_the_flow(dep, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(ROOT)
    flow = load_flow_from_entrypoint(dep["entrypoint"])
    sig = inspect.signature(flow.fn)
    params = dep.get("parameters", {})
    unknown = set(params) - set(sig.parameters)
    assert not unknown, f"{dep['name']}: parameters the flow does not take: {unknown}"
    required = {n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty}
    assert required <= set(params), f"{dep['name']}: required parameters missing: {required - set(params)}"
    flow.validate_parameters(params)  # types coerce as Prefect will at run time


@pytest.mark.parametrize("dep", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_every_schedule_parses(dep):
    from prefect.client.schemas.schedules import CronSchedule

    assert dep.get("schedules"), f"{dep['name']} has no schedule"
    for s in dep["schedules"]:
        sched = CronSchedule(cron=s["cron"], timezone=s.get("timezone", "UTC"))
        assert sched.cron == s["cron"]


def test_the_short_plans_schedule_runs_every_cadence_minutes():
    from flows.spec import CadenceSpec

    dep = next(d for d in DEPLOYMENTS if d["name"] == "plan-5min")
    minutes = dep["parameters"]["cadence"]["minutes"]
    assert dep["schedules"][0]["cron"] == f"*/{minutes} * * * *"  # the schedule and the parameter agree
    assert minutes == CadenceSpec().minutes == 5  # the flow parameter's default: every 5 minutes


def test_gc_runs_every_15_minutes_and_the_prefill_uses_the_gpu_pool():
    by = {d["name"]: d for d in DEPLOYMENTS}
    assert by["gc-15min"]["schedules"][0]["cron"] == "*/15 * * * *"
    assert by["prefill-offpeak"]["work_pool"]["name"] == "kvwarm-gpu"
    assert by["plan-hourly"]["parameters"]["plan"]["schedule_prefill"] == "prefill-plan/prefill-offpeak"


def test_the_sharded_prefill_runs_its_shards_on_the_gpu_deployment_from_the_cpu_pool():
    by = {d["name"]: d for d in DEPLOYMENTS}
    parent = by["prefill-sharded"]
    assert parent["work_pool"]["name"] == "kvwarm-cpu", "the parent only waits: it must not hold a GPU worker"
    assert parent["parameters"]["prefill"] == {"shards": "auto", "shard_deployment": "prefill-plan/prefill-offpeak"}
    assert parent["schedules"][0]["active"] is False, "one fallback cron per window: prefill-offpeak's"


def test_every_stage_of_the_set_works_on_one_run_target():
    """The plan and the prefill must agree on store, config, model and block size: one target for all."""
    targets = [d["parameters"]["target"] for d in DEPLOYMENTS if "run" in d["parameters"]["target"]]
    assert len(targets) == 6 and all(t == targets[0] for t in targets) and targets[0]["run"] == "prod"
    gc = next(d for d in DEPLOYMENTS if d["name"] == "gc-15min")["parameters"]["target"]
    assert gc == {k: v for k, v in targets[0].items() if k != "run"}  # the whole store, no run


def test_a_misspelt_knob_in_a_deployment_is_refused_naming_it(monkeypatch):
    from prefect.exceptions import ParameterTypeError
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(ROOT)
    dep = next(d for d in DEPLOYMENTS if d["name"] == "plan-hourly")
    params = {**dep["parameters"], "plan": {**dep["parameters"]["plan"], "budget_gpu_sec": 60}}
    with pytest.raises(ParameterTypeError, match=r"plan\.budget_gpu_sec: Extra inputs are not permitted"):
        load_flow_from_entrypoint(dep["entrypoint"]).validate_parameters(params)


def test_every_section_of_the_run_spec_is_a_parameter_of_some_stage_flow():
    """What the pipeline can set, a deployment of a stage can set too (the stage switches aside)."""
    import typing

    from flows import cadence, pipeline
    from flows.spec import RunSpec

    stages = [pipeline.mine_logs, pipeline.forecast_demand, pipeline.plan_prewarm, pipeline.prefill_plan,
              pipeline.gc_store, pipeline.report, cadence.plan_cadence]
    taken = {hint for f in stages for name, hint in typing.get_type_hints(f.fn).items() if name != "return"}
    sections = {name: field.annotation for name, field in RunSpec.model_fields.items()}
    assert {name for name, kind in sections.items() if kind not in taken} == {"stages"}


@pytest.mark.parametrize("dep", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_the_ui_form_of_each_deployment_describes_its_sections(dep, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    monkeypatch.chdir(ROOT)
    schema = parameter_schema(load_flow_from_entrypoint(dep["entrypoint"])).model_dump()
    assert "RunTarget" in schema["definitions"] and "target" in schema["required"]
    for section in dep["parameters"]:
        ref = schema["properties"][section]["$ref"].rsplit("/", 1)[-1]
        fields = schema["definitions"][ref]["properties"]
        assert set(dep["parameters"][section]) <= set(fields)
        assert all(f.get("description") for f in fields.values()), f"{ref}: every knob says what it does"
