"""The replay's kvwarm node is the shipped node agent: the same class takes plans in the replay
and in the vLLM connector, and a simulated node follows every plan of the cadence."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from forecasting.ingest.log_trace import requests_from_trace
from forecasting.ingest.traces import read_mooncake
from forecasting.simulate.kvwarm_policy import planner_for, retain_spec
from forecasting.simulate.live_node import AgentRun, SimClock, SimFleet, SimPlans
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.simulation import Deployment, Scenario, simulate
from store.engines.vllm.agents import start_agents
from store.plan import Plan, PlanEntry, write_plan
from store.serving.agent import NodeAgent
from tests.store.engines.vllm.worker_setup import KB, store_blocks, tokens, worker  # noqa: F401 - fixture

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"


@pytest.fixture(scope="module")
def head() -> BlockIndex:
    return BlockIndex.build(read_mooncake(MOONCAKE))


@pytest.fixture()
def applied(monkeypatch):
    """Every ranking :class:`NodeAgent` applies, with the agent's hands' type."""
    seen: list[str] = []
    real = NodeAgent._apply

    def spy(self, now, *, others_only):  # noqa: ANN001, ANN202
        seen.append(type(self.hands).__name__)
        return real(self, now, others_only=others_only)

    monkeypatch.setattr(NodeAgent, "_apply", spy)
    return seen


def test_the_replay_and_the_connector_take_plans_through_the_same_agent(head, applied, tmp_path, worker):  # noqa: F811
    deployment = Deployment.default(512)
    planner = planner_for(head.trace, requests_from_trace(head.trace), retain_spec(deployment), deployment,
                          cadence_s=120.0)
    simulate(head, deployment, [Scenario("replacement", at_s=300.0, window_s=120.0)], ("kvwarm",), planner=planner)
    assert "SimHands" in applied  # the replay's node took its plans through NodeAgent
    ids = tokens(2 * KB, seed=3)
    store_blocks(tmp_path, ids)
    plan = write_plan(Plan(entries=(PlanEntry("acme", token_ids=tuple(ids), expected_hits=2.0),)), tmp_path / "p.json")
    agents = start_agents(worker, replace(worker.settings, plan=str(plan)), None)
    try:
        assert all(isinstance(a, NodeAgent) for a in agents.agents)
        deadline = time.monotonic() + 30
        while "LoaderNode" not in applied and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        agents.close()
    assert "LoaderNode" in applied  # and the connector's


def test_a_simulated_node_notices_each_plan_at_its_next_poll(head):
    deployment = Deployment.default(512)
    planner = planner_for(head.trace, requests_from_trace(head.trace), retain_spec(deployment), deployment,
                          cadence_s=120.0)
    from forecasting.simulate.policies import kvwarm_plans, written_back
    from forecasting.simulate.tiers import Node

    stored = written_back(head)
    ticks = kvwarm_plans(head, planner, stored, 400.0)
    run = AgentRun(Node(head, deployment.shape, deployment.costs, stored), ticks, SimFleet(head, np.zeros(0, int)))
    ts = head.trace.timestamps_s
    rows = np.flatnonzero(ts < 400.0)
    run.serve(rows)
    # three plans (120, 240, 360 s), each taken at the first poll after it (every 30 s)
    assert run.agent.figures.plans_applied == 3
    assert run.agent.plan is ticks[-1].plan


def test_sim_plans_and_fleet_see_only_the_past(head):
    clock = SimClock(100.0)

    class Tick:
        def __init__(self, at, plan):
            self.at_s, self.plan = at, plan

    plans = SimPlans([Tick(50.0, Plan(entries=())), Tick(150.0, Plan(entries=(), created_at=1.0))], clock)
    assert plans.version() == "0" and plans.read().created_at == 0.0
    clock.t = 150.0
    assert plans.version() == "1"
    ts = head.trace.timestamps_s
    rows = np.arange(len(ts))
    fleet = SimFleet(head, rows, flush_s=30.0)
    now = float(ts[200])
    uses = fleet.uses(0.0, now, others_only=True)
    assert uses and all(u.at < now - 30.0 for u in uses)
    assert uses == sorted(uses, key=lambda u: -u.at)
    newest = uses[0]
    assert newest.traffic_age == 0 or newest.at == max(u.at for u in uses)
