"""The sharded prefill for real: a Prefect server on 127.0.0.1, a process pool with 2 workers, the
prefill deployment run once per shard by the parent flow with ``run_deployment``.

The repository's prefect.yaml is deployed as is, except that the GPU deployment's ``prefill``
section says cpu/fp32 (this machine has no GPU). The GPU pool's two workers take one flow run
at a time (``--limit 1``), as a GPU host's worker does. Their flow runs import
``tests/flows/shard_gate/sitecustomize.py``, which does nothing unless a test puts a file in
the gate folder: a slow ``Store.put`` (the deadline test) or a stop mid-shard (the kill test).
The workers started here are stopped by pid at the end of the module, the server at the end of
the package (the ``prefect_server`` fixture of tests/flows/conftest.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from flows.pipeline import prefill_plan
from flows.shards import online_workers
from flows.spec import PrefillSpec, RunTarget
from prefill.cli import main as prefill_cli
from prefill.rundir import RunDir
from store.plan import Plan, write_plan
from tests.flows.prefect_server import ROOT, PrefectServer
from tests.prefill.shard_plans import BLOCK, independent_plan, shared_prompt_plan, under_system

GATE_CODE = Path(__file__).resolve().parent / "shard_gate"
SHARD_DEPLOYMENT = "prefill-plan/prefill-offpeak"
#: a hang guard only: the parent gives up on a shard this long after the deadline
GENEROUS_S = 900.0


@pytest.fixture(scope="module")
def gpu_pool(prefect_server: PrefectServer, tmp_path_factory):
    """Pools, the deployments (prefill on cpu), and two GPU-pool workers that take one run each at a time."""
    gate = tmp_path_factory.mktemp("gate")
    doc = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    doc["pull"] = [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    for d in doc["deployments"]:
        if d["name"] == "prefill-offpeak":
            d["parameters"]["prefill"] = {"device": "cpu", "dtype": "fp32"}
    spec = prefect_server.root / "prefect-cpu.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    prefect_server.create_pools()
    env = {"KVWARM_TEST_GATE": str(gate), "PYTHONPATH": os.pathsep.join([str(GATE_CODE), str(ROOT)])}
    workers = [prefect_server.start_worker("kvwarm-gpu", name=f"gpu-{n}", args=["--limit", "1"], **env)
               for n in ("a", "b")]
    prefect_server.cli("--no-prompt", "deploy", "--all", "--prefect-file", str(spec))
    give_up = time.monotonic() + 120
    with prefect_server.api():
        while online_workers("kvwarm-gpu") < 2:
            dead = [w for w in workers if not w.alive()]
            assert not dead and time.monotonic() < give_up, \
                f"the GPU pool's workers are not online:\n{''.join(w.tail() for w in workers)}"
            time.sleep(0.5)
    prefect_server.gate = gate  # type: ignore[attr-defined]
    return prefect_server


def _target(tmp_path: Path, run: str, plan: Plan) -> RunTarget:
    target = RunTarget(store=f"file://{tmp_path / 'store'}", run=run, model="kvwarm-tiny", block_size=BLOCK)
    write_plan(plan, RunDir.of(target.store, run).plan)
    return target


def _snapshots(tmp_path: Path) -> list[Path]:
    objects = tmp_path / "store" / "objects"
    return list(objects.rglob("*.kvw")) if objects.exists() else []


def _distinct_blocks(plan: Plan) -> int:
    return len({e.token_ids[:(d + 1) * BLOCK] for e in plan.entries for d in range(len(e.token_ids) // BLOCK)})


def _summary(target: RunTarget) -> dict:
    return json.loads(RunDir.of(target.store, target.run).prefill.read_text())


def _logs(server: PrefectServer, flow_run_id: str) -> str:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with server.api(), get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(log.message for log in logs)


def _ran(worker, flow_run_id: str) -> bool:
    """Whether ``worker`` ran the flow run (both may try to submit it; the server aborts one)."""
    log = worker.tail(10**7)
    return f"submitting flow run '{flow_run_id}'" in log and f"Aborted submission of flow run '{flow_run_id}'" not in log


def _run_parent(server: PrefectServer, target: RunTarget, prefill: PrefillSpec, deadline: float):
    with server.api():
        return prefill_plan(target, prefill, deadline, return_state=True)


def _why(server: PrefectServer, state) -> str:
    return (f"parent ended {state!r}; worker logs:\n" + "\n".join(w.tail(4000) for w in server.workers))


def test_a_plan_in_two_shards_stores_every_block_once_and_the_system_prompt_is_computed_once(gpu_pool, tmp_path):
    plan = shared_prompt_plan()
    target = _target(tmp_path, "shards-1", plan)
    state = _run_parent(gpu_pool, target, PrefillSpec(shards="auto"), time.time() + GENEROUS_S)
    assert state.is_completed(), _why(gpu_pool, state)
    summary = _summary(target)
    rows = summary["shards"]
    assert len(rows) == 2, "auto: one shard per online worker of the pool"
    assert [r["state"] for r in rows] == ["COMPLETED", "COMPLETED"]
    distinct = _distinct_blocks(plan)
    # every planned block stored exactly once, and computed once: no shard recomputed another's
    assert len(_snapshots(tmp_path)) == distinct == summary["blocks_written"]
    assert summary["tokens_computed"] == distinct * BLOCK
    for r in rows:  # forward tokens per shard: each computed exactly the blocks it owns
        assert r["tokens_computed"] == r["assignment"]["est_tokens"] > 0
        assert r["forward_tokens"] >= r["tokens_computed"] and r["blocks_skipped"] == 0
    (owner,) = [r for r in rows if r["assignment"]["computes"]]
    (waiter,) = [r for r in rows if r["assignment"]["waits"]]
    assert owner["shard"] != waiter["shard"]
    (wait,) = waiter["waits"]
    assert wait["found"] and wait["owner"] == owner["shard"] and wait["blocks"] == 2
    under = set(under_system(plan))
    assert under & set(owner["assignment"]["entries"]) and under & set(waiter["assignment"]["entries"])
    assert "waiting for the shared prefix" in _logs(gpu_pool, waiter["flow_run"]), "the flow shows the wait"
    # a rerun of the parent computes only what is missing: nothing
    again = _run_parent(gpu_pool, target, PrefillSpec(shards=2), time.time() + GENEROUS_S)
    assert again.is_completed(), _why(gpu_pool, again)
    rerun = _summary(target)
    assert rerun["tokens_computed"] == 0 and rerun["blocks_written"] == 0
    assert all(r["blocks_stored_before"] == r["blocks_total"] for r in rerun["shards"])


def test_a_short_deadline_cuts_the_least_valuable_part_of_each_shard_before_it(gpu_pool, tmp_path):
    plan = independent_plan(160, 2)
    target = _target(tmp_path, "shards-deadline", plan)
    delay = gpu_pool.gate / "put-delay"
    # A slow device: a batch of 4 blocks takes 6 s, so a shard's 160 blocks need 240 s, more than the window
    # holds even when a shard starts at once. A shard's process takes from seconds to a minute to start here
    # (49 s on the loaded two-core machine: 15 s to Prefect's engine, 18 s to import the flow, 11 s to load
    # the model), so the window leaves it over two minutes of work to cut.
    delay.write_text("1.5")
    try:
        deadline = time.time() + 180.0
        state = _run_parent(gpu_pool, target, PrefillSpec(shards=2, max_batch_tokens=4 * BLOCK), deadline)
    finally:
        delay.unlink()
    assert state.is_completed(), _why(gpu_pool, state)
    summary = _summary(target)
    assert summary["stopped"] == "deadline" and summary["cut"]
    for r in summary["shards"]:
        assert r["state"] == "COMPLETED" and r["stopped"] == "deadline"
        assert r["finished_at"] <= deadline, f"shard {r['shard']} ran past the deadline"
        done = [e for e in r["assignment"]["entries"] if e not in r["cut"]]
        assert done and r["cut"], f"shard {r['shard']}: computed {done}, cut {r['cut']}"
        assert max(done) < min(r["cut"]), "a cut entry is worth more than a computed one"
        assert r["blocks_left"] == 2 * len(r["cut"])
    assert summary["cut"] == sorted(e for r in summary["shards"] for e in r["cut"])
    assert summary["blocks_left"] == 2 * len(summary["cut"])


def test_a_worker_killed_mid_shard_fails_the_parent_naming_it_and_a_rerun_computes_only_the_rest(gpu_pool,
                                                                                                  tmp_path):
    from prefect.deployments import run_deployment

    plan = shared_prompt_plan(seed=7)
    target = _target(tmp_path, "shards-kill", plan)
    gate = gpu_pool.gate
    (gate / "pause-after").write_text("6")  # the first shard to start stops in its 7th write
    paused = gate / "paused"

    def kill_when_paused() -> None:
        give_up = time.monotonic() + 300
        while not paused.exists() and time.monotonic() < give_up:
            time.sleep(0.2)
        if paused.exists():
            pid = int(paused.read_text().split()[0])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_paused, daemon=True)
    killer.start()
    try:
        state = _run_parent(gpu_pool, target, PrefillSpec(shards=2), time.time() + GENEROUS_S)
    finally:
        (gate / "pause-after").unlink()
    killer.join(timeout=60)
    assert paused.exists(), _why(gpu_pool, state)
    written_before_kill = int(paused.read_text().split()[1])
    assert state.is_failed(), _why(gpu_pool, state)
    summary = _summary(target)
    (dead,) = [r for r in summary["shards"] if r["state"] != "COMPLETED"]
    (alive,) = [r for r in summary["shards"] if r["state"] == "COMPLETED"]
    assert summary["failed"] == [dead["shard"]]
    assert f"shard {dead['shard']}/2" in state.message and dead["state"] in state.message
    assert dead["state"] == "CRASHED"
    # no partial snapshot is visible: every file the killed shard left is whole and verifies
    assert prefill_cli(["store", "--store", target.store, "verify"]) == 0
    assert len(_snapshots(tmp_path)) == written_before_kill + alive["blocks_written"]
    # the worker that ran it goes too; the shard reruns on the other one
    (host,) = [w for w in gpu_pool.workers if _ran(w, dead["flow_run"])]
    host.stop()
    with gpu_pool.api():
        run = run_deployment(SHARD_DEPLOYMENT, timeout=0, as_subflow=False,
                             parameters={"target": target.model_dump(mode="json"), "deadline": time.time() + GENEROUS_S,
                                         "shard": dead["assignment"]})
    final = gpu_pool.wait_for_run(run.id, timeout_s=300)
    assert final.state is not None and final.state.is_completed(), _why(gpu_pool, final.state)
    result = json.loads(RunDir.of(target.store, target.run).shard_result(dead["shard"]).read_text())
    assert result["flow_run"] == str(run.id)
    assert result["blocks_stored_before"] >= written_before_kill > 0
    assert result["blocks_written"] == result["blocks_total"] - result["blocks_stored_before"]
    assert result["tokens_computed"] == result["blocks_written"] * BLOCK and result["blocks_skipped"] == 0
    assert result["blocks_left"] == 0 and not result["cut"]
    assert len(_snapshots(tmp_path)) == _distinct_blocks(plan)
    assert prefill_cli(["store", "--store", target.store, "verify"]) == 0
