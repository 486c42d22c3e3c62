"""The deployments for real: a Prefect server on 127.0.0.1, the pools, ``prefect deploy --all``,
a process worker running a deployment to completion, and the prefill scheduled at a window's start.

Everything runs as the README's "Running the pipeline on a schedule" says, from this
repository: the server, the CLI and the worker are separate processes, stopped by pid
at the end of the module (tests/flows/prefect_server.py).
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from uuid import UUID

import yaml

from flows.scheduling import DEFAULT_PREFILL_DEPLOYMENT, schedule_prefill
from flows.spec import RunTarget
from store.config import KvwarmConfig
from store.tiers.base import object_name
from store.tiers.store import Store
from tests.flows.prefect_server import ROOT
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


def _flow_name(entrypoint: str) -> str:
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(str(ROOT / entrypoint)).name


def test_deploy_all_registers_every_deployment_on_its_pool(kvwarm_deployments) -> None:
    from prefect import get_client

    with kvwarm_deployments.api(), get_client(sync_client=True) as client:
        found = {}
        for d in client.read_deployments():
            found[f"{client.read_flow(d.flow_id).name}/{d.name}"] = d
        pools = {p.name: p.type for p in client.read_work_pools()}
    assert pools == {"kvwarm-cpu": "process", "kvwarm-gpu": "process"}
    expected = {f"{_flow_name(d['entrypoint'])}/{d['name']}": d for d in DEPLOYMENTS}
    assert set(found) == set(expected)
    for name, d in expected.items():
        assert found[name].work_pool_name == d["work_pool"]["name"], name
        assert found[name].entrypoint == d["entrypoint"], name
        # `prefect deploy` fills in {{ $KVWARM_REPO }} from its own environment: the path is
        # fixed at deploy time, and a worker's clone must be at that path.
        assert found[name].pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                           {"directory": str(ROOT)}}], name


def test_gc_deployment_runs_through_a_process_worker_and_collects_the_store(kvwarm_deployments, cpu_worker,
                                                                            tmp_path: Path) -> None:
    from prefect import get_client
    from prefect.deployments import run_deployment

    url = f"file://{tmp_path / 'store'}"
    store = Store.open(url, KvwarmConfig())
    root = make_root()
    old_block, live_block = make_chain(root, 2)
    now = time.time()
    old = make_snapshot(root, old_block, created_at=now - 7200, ttl_s=60, seed=1)
    live = make_snapshot(root, live_block, created_at=now, ttl_s=3600, seed=2)
    assert store.put(ACME, old) and store.put(ACME, live)
    assert {e.name for e in store.local.entries()} == {object_name("acme", old.key), object_name("acme", live.key)}
    store.close()

    with kvwarm_deployments.api():
        submitted = run_deployment("gc-store/gc-15min", timeout=0, as_subflow=False,
                                   parameters={"target": {"store": url, "block_size": 16, "run": "live"}})
    run = kvwarm_deployments.wait_for_run(submitted.id, timeout_s=300)  # a hang guard: it returns once the run ends
    assert run.state is not None and run.state.is_completed(), (
        f"flow run {run.id} ended {run.state!r}, not COMPLETED; worker log:\n{cpu_worker.tail()}\n"
        f"server log:\n{kvwarm_deployments.server.tail(2000) if kvwarm_deployments.server else ''}")
    assert run.work_pool_name == "kvwarm-cpu"
    assert str(run.id) in cpu_worker.log.read_text(errors="replace"), "the worker did not run it"

    report = json.loads((tmp_path / "store" / "_flows" / "live" / "gc.json").read_text())
    assert report["expired_removed"] == 1 and report["evicted"] == 0
    reopened = Store.open(url, KvwarmConfig())
    try:
        assert {e.name for e in reopened.local.entries()} == {object_name("acme", live.key)}
    finally:
        reopened.close()
    with kvwarm_deployments.api(), get_client(sync_client=True) as client:
        assert client.read_flow(client.read_flow_run(run.id).flow_id).name == "gc-store"


def _window(start: datetime, hours: float = 3.0) -> dict:
    """A window as forecast_demand writes it (str of naive UTC pandas Timestamps)."""
    naive = start.astimezone(timezone.utc).replace(tzinfo=None)
    return {"chosen": {"start": str(naive), "end": str(naive + timedelta(hours=hours)), "mean_load": 1.0,
                       "max_load": 2.0}, "offpeak": [], "fraction": 0.6}


def test_schedule_prefill_creates_a_scheduled_run_at_the_window_start(kvwarm_deployments, tmp_path: Path) -> None:
    from prefect import get_client

    start = (datetime.now(timezone.utc) + timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
    end = start + timedelta(hours=3)
    target = RunTarget(store=f"file://{tmp_path / 'store'}", run="night-1", model="kvwarm-tiny", block_size=16)
    with kvwarm_deployments.api():
        run_id = schedule_prefill(target, _window(start))
        assert run_id is not None
        assert schedule_prefill(target, _window(start)) == run_id, \
            "a rerun of the plan must not schedule a second prefill"
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(run_id))
            deployment = client.read_deployment(run.deployment_id)
            flow = client.read_flow(deployment.flow_id)
    assert f"{flow.name}/{deployment.name}" == DEFAULT_PREFILL_DEPLOYMENT == "prefill-plan/prefill-offpeak"
    assert run.state is not None and run.state.is_scheduled()
    assert run.state.state_details.scheduled_time == start
    assert run.expected_start_time == start
    assert run.work_pool_name == "kvwarm-gpu"
    p = run.parameters
    assert RunTarget.model_validate(p["target"]) == target and p["deadline"] == end.timestamp()
    assert p["prefill"] == {"device": "cuda", "dtype": "bf16"}, "the deployment's own prefill section fills the rest"


def test_a_window_already_started_is_scheduled_now(kvwarm_deployments, tmp_path: Path) -> None:
    from prefect import get_client

    start = datetime.now(timezone.utc) - timedelta(hours=1)
    before = datetime.now(timezone.utc)
    with kvwarm_deployments.api():
        run_id = schedule_prefill(RunTarget(store=f"file://{tmp_path}", run="late-1"), _window(start))
        after = datetime.now(timezone.utc)
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(run_id))
    assert before - timedelta(seconds=1) <= run.expected_start_time <= after + timedelta(seconds=1)


def test_an_unknown_deployment_leaves_the_prefill_to_cron(kvwarm_deployments, tmp_path: Path, caplog) -> None:
    start = datetime.now(timezone.utc) + timedelta(hours=5)
    with kvwarm_deployments.api(), caplog.at_level("WARNING", logger="flows.scheduling"):
        got = schedule_prefill(RunTarget(store=f"file://{tmp_path}", run="r"), _window(start),
                               deployment="prefill-plan/not-deployed")
    assert got is None
    assert "not registered" in caplog.text and "cron schedule" in caplog.text
