"""The node agent: follows the published plan for the node's life (poll the version, read
only what changed, replace priorities and copies), and warms from the fleet's memory."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from store.errors import ConfigError, StoreUnavailable
from store.plan import Plan, PlanEntry, PlanError, write_plan
from store.published_plan import PublishedEntry, PublishedPlan, publish_plan
from store.serving.agent import AgentSettings, AgentThread, FilePlan, NodeAgent, StorePlans
from store.serving.urgency import PlanChain
from store.tiers.local import LocalTier


@dataclass(frozen=True)
class U:
    name: str
    at: float
    uses: int
    traffic_age: int


@dataclass
class Node:
    """A node as the agent sees it, in memory: what it holds, its priorities, its copy queue."""

    holds: set = field(default_factory=set)
    records: list = field(default_factory=list)
    own: set = field(default_factory=set)  # names of the records this node made itself
    priority: dict = field(default_factory=dict)
    queue: list = field(default_factory=list)
    prefetches: int = 0
    fleet_asks: list = field(default_factory=list)

    def plan_chains(self, plan):
        return [PlanChain(tuple(f"{e.tenant}:{t}" for t in e.token_ids), e.expected_hits, e.score)
                for e in plan.entries]

    def fleet(self, since, *, others_only):
        self.fleet_asks.append((since, others_only))
        return [u for u in self.records if u.at >= since and not (others_only and u.name in self.own)]

    def held(self):
        return self.holds

    def capacity(self):
        return 100

    def copy_s(self):
        return 0.0

    def retain(self, priority):
        self.priority = priority

    def prefetch(self, order):
        self.queue = list(order)
        self.prefetches += 1


class Plans:
    def __init__(self):
        self.plan = None
        self.v = 0
        self.reads = 0
        self.fail = None

    def publish(self, *tokens, hits=1.0):
        self.plan = Plan(entries=tuple(PlanEntry(tenant="t", token_ids=(t,), expected_hits=hits) for t in tokens))
        self.v += 1

    def version(self):
        if isinstance(self.fail, StoreUnavailable):
            raise self.fail
        return str(self.v) if self.plan is not None else None

    def read(self):
        self.reads += 1
        if isinstance(self.fail, PlanError):
            raise self.fail
        return self.plan


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def agent(node, plans, **kw):
    clock = Clock()
    return NodeAgent(node, plans, AgentSettings(poll_s=30.0, **kw), clock=clock), clock


def test_start_applies_the_latest_plan_and_the_fleet():
    node, plans = Node(records=[U("f1", 900.0, 2, 0)]), Plans()
    plans.publish(1, 2)
    a, _ = agent(node, plans)
    warm = a.start()
    assert set(node.queue) == {"t:1", "t:2", "f1"} and node.priority.keys() == {"t:1", "t:2"}
    assert warm.sources()["fleet"] == 1 and node.fleet_asks == [(1000.0 - 3600.0, False)]
    assert a.figures.plans_applied == 1


def test_a_new_plan_is_noticed_by_its_version_and_replaces_the_last():
    node, plans = Node(), Plans()
    plans.publish(1, 2)
    a, clock = agent(node, plans)
    a.start()
    assert plans.reads == 1
    clock.t += 10
    assert a.tick() is None and plans.reads == 1  # not time to poll yet
    clock.t += 25
    assert a.tick() is None and plans.reads == 1  # polled: same version, the plan is not read again
    plans.publish(3)
    clock.t += 5
    assert a.tick() is None  # the next poll is 30 s after the last
    clock.t += 30
    warm = a.tick()
    assert warm is not None and plans.reads == 2
    assert node.queue == ["t:3"] and set(node.priority) == {"t:3"}  # priorities replaced, not merged
    assert node.prefetches == 2
    assert node.fleet_asks[-1][1] is True  # a running node reads only the other nodes' records


def test_held_blocks_are_retained_but_not_copied():
    node, plans = Node(holds={"t:1"}), Plans()
    plans.publish(1, 2)
    a, _ = agent(node, plans)
    a.start()
    assert node.queue == ["t:2"] and set(node.priority) == {"t:1", "t:2"}


def test_an_unusable_plan_keeps_the_last_and_is_not_reread_until_a_newer_one():
    node, plans = Node(), Plans()
    plans.publish(1)
    a, clock = agent(node, plans)
    a.start()
    plans.publish(2)
    plans.fail = PlanError("entry 0: bad")
    clock.t += 31
    assert a.tick() is None and a.figures.plan_errors == 1 and node.queue == ["t:1"]
    clock.t += 31
    assert a.tick() is None and plans.reads == 2  # that version is known bad: not read again
    plans.fail = None
    plans.publish(4)
    clock.t += 31
    assert a.tick() is not None and node.queue == ["t:4"]


def test_an_unreachable_store_keeps_the_plan():
    node, plans = Node(), Plans()
    plans.publish(1)
    a, clock = agent(node, plans)
    a.start()
    plans.fail = StoreUnavailable("s3 down")
    clock.t += 31
    assert a.tick() is None and node.queue == ["t:1"]


def test_no_plan_source_warms_from_the_fleet_alone_and_fleet_can_be_turned_off():
    node = Node(records=[U("f1", 900.0, 1, 0), U("f0", 100.0, 1, 0), U("gone", -3000.0, 9, 0)])
    a, _ = agent(node, None)
    a.start()
    assert node.queue == ["f1", "f0"]  # most recent first; "gone" is older than the hour's window
    node2 = Node(records=[U("f1", 900.0, 1, 0)])
    b, _ = agent(node2, None, fleet_memory=False)
    b.start()
    assert node2.queue == [] and node2.fleet_asks == []


def test_settings_refuse_bad_values():
    with pytest.raises(ConfigError, match="poll_s"):
        AgentSettings(poll_s=0)
    with pytest.raises(ConfigError, match="min_value"):
        AgentSettings(min_value=1.0)


def test_store_plans_version_changes_only_with_a_new_plan(tmp_path):
    tier = LocalTier(tmp_path / "t", cap_bytes=1 << 20)
    src = StorePlans([tier])
    assert src.version() is None and src.read() is None
    p1 = PublishedPlan(entries=(PublishedEntry(namespace="t", root="0" * 32, keys=("a" * 64,)),), created_at=1.0)
    publish_plan(p1, [tier])
    v1 = src.version()
    publish_plan(p1, [tier])
    assert src.version() == v1
    publish_plan(PublishedPlan(entries=p1.entries, created_at=2.0), [tier])
    assert src.version() != v1 and src.read().created_at == 2.0


def test_file_plan_version_follows_the_file(tmp_path):
    path = tmp_path / "plan.json"
    src = FilePlan(path)
    assert src.version() is None
    write_plan(Plan(entries=(PlanEntry(tenant="t", token_ids=(1,)),)), path)
    v1 = src.version()
    time.sleep(0.01)
    write_plan(Plan(entries=(PlanEntry(tenant="t", token_ids=(1, 2)),)), path)
    assert src.version() != v1 and len(src.read().entries[0].token_ids) == 2


def test_the_thread_starts_polls_and_stops():
    node, plans = Node(), Plans()
    plans.publish(1)
    a = NodeAgent(node, plans, AgentSettings(poll_s=0.05))
    t = AgentThread([a]).start()
    deadline = time.monotonic() + 10
    while node.prefetches < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    plans.publish(2)
    while node.queue != ["t:2"] and time.monotonic() < deadline:
        time.sleep(0.01)
    t.close()
    assert node.queue == ["t:2"]
    assert not any(th.name == "kvwarm-agent" for th in threading.enumerate())
