"""prefect.yaml checked without a server: entrypoints load, schedules parse, parameters fit."""
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
    assert {"mine-hourly", "forecast-hourly", "plan-hourly", "prefill-offpeak", "gc-15min"} <= names
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


def test_gc_runs_every_15_minutes_and_the_prefill_uses_the_gpu_pool():
    by = {d["name"]: d for d in DEPLOYMENTS}
    assert by["gc-15min"]["schedules"][0]["cron"] == "*/15 * * * *"
    assert by["prefill-offpeak"]["work_pool"]["name"] == "kvwarm-gpu"
    assert by["plan-hourly"]["parameters"]["schedule_prefill"] == "prefill-plan/prefill-offpeak"
