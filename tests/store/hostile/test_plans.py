"""Attacks on the plan (issue 31, points 2 and 4): what the published plan reveals to anyone
who reads the store's metadata, and what a plan with the wrong types does to a node agent.

Each test reproduces one attack with the real components: the pipeline's publishing task
(``flows.tasks.publish_latest_plan``) and its run directory, a real store, the node agent
reading a real plan file or the store's latest plan.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from prefill.models import LoadedModel
from store.config import parse_config
from store.plan import Plan, PlanEntry, PlanError, parse_plan
from store.serving.agent import AgentSettings, FilePlan, NodeAgent
from store.serving.urgency import PlanChain
from store.tiers.store import Store
from tests.store.pool_workers import TINY

SECRET = "acme-secret-long-enough-for-any-minimum-0123456789"
VAULT_SECRET = "vault-secret-long-enough-for-any-minimum-0123456789"
VAULT_KEY = "11" * 32
PROMPT = "You are the payroll assistant of ACME Corp. Salaries: Alice 123456, Bob 654321."


class ByteTokenizer:
    """A tokenizer of bytes (the model's tokenizer is not what these tests attack)."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [b % 384 for b in text.encode("utf-8")]}


def loaded() -> LoadedModel:
    return LoadedModel(name="tiny", path=Path("."), model=None, tokenizer=ByteTokenizer(), config=None,
                       identity=TINY, chat_identity=None, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    """A store, and the pipeline's config: acme with a secret, vault with a secret and an encryption key."""
    monkeypatch.setenv("ACME_SECRET", SECRET)
    monkeypatch.setenv("VAULT_SECRET", VAULT_SECRET)
    monkeypatch.setenv("VAULT_KEY", VAULT_KEY)
    cfg = parse_config({"kv_cache": {"block_size": 16},
                        "tenants": {"acme": {"secret_env": "ACME_SECRET"},
                                    "vault": {"secret_env": "VAULT_SECRET", "encryption_key_env": "VAULT_KEY"}}})
    return f"file://{tmp_path}/nvme", cfg, tmp_path


def published_bytes(url: str, cfg) -> bytes:
    from store.published_plan import LATEST_PLAN

    store = Store.open(url, cfg)
    try:
        raw = store.tiers[0].get_meta(LATEST_PLAN)
        assert raw is not None
        return raw
    finally:
        store.close()


def publish(plan: Plan, url: str, cfg) -> bytes:
    from flows.tasks import publish_latest_plan

    publish_latest_plan.fn(plan, url, cfg, loaded())
    return published_bytes(url, cfg)


def test_attack_published_plan_reveals_a_tenants_text(pipeline) -> None:
    url, cfg, _ = pipeline
    raw = publish(Plan(entries=(PlanEntry("acme", text=PROMPT, score=2.0),)), url, cfg)
    assert b"payroll" not in raw and b"Alice" not in raw and b'"text"' not in raw
    from store.published_plan import latest_plan

    store = Store.open(url, cfg)
    plan = latest_plan(store.tiers)
    store.close()
    assert plan is not None and plan.entries[0].namespace == "acme" and plan.entries[0].blocks == len(PROMPT) // 16


def test_attack_published_plan_reveals_token_ids(pipeline) -> None:
    url, cfg, _ = pipeline
    ids = tuple(range(300, 348))  # three blocks of ids no key, score or size spells out
    raw = publish(Plan(entries=(PlanEntry("acme", token_ids=ids, action="retain", urgency=0.5),)), url, cfg)
    doc = json.loads(raw)
    assert "token_ids" not in raw.decode() and "hash_ids" not in raw.decode()
    assert ", ".join(map(str, ids[:4])) not in json.dumps(doc) and "301, 302" not in json.dumps(doc)
    assert [len(e["keys"]) for e in doc["entries"]] == [3]


def test_attack_published_plan_reveals_an_encrypted_tenants_prompts(pipeline) -> None:
    from flows.tasks import read_run_plan, save_plan

    url, cfg, tmp = pipeline
    plan = Plan(entries=(PlanEntry("vault", text=PROMPT, score=3.0), PlanEntry("acme", token_ids=tuple(range(32)))))
    raw = publish(plan, url, cfg)
    assert b"payroll" not in raw and b"Salaries" not in raw
    # the plan with the prompts stays in the run directory, the encrypted tenant's sealed with its key
    path = save_plan.fn(plan, tmp / "run" / "plan.json", cfg)
    assert b"payroll" not in path.read_bytes() and b"Salaries" not in path.read_bytes()
    assert read_run_plan(path, cfg).entries == plan.entries  # the prefill job reads it back whole


# -- a plan with correct JSON and wrong types --------------------------------------------

@dataclass
class Node:
    """A node as the agent sees it (in memory: the agent is what is attacked here)."""

    records: list = field(default_factory=list)
    queue: list | None = None
    priority: dict = field(default_factory=dict)

    def plan_chains(self, plan):
        return [PlanChain(tuple(f"{e.tenant}:{t}" for t in e.token_ids), e.expected_hits, e.score)
                for e in plan.entries]

    def fleet(self, since, *, others_only):
        return [r for r in self.records if r.at >= since]

    def held(self):
        return set()

    def capacity(self):
        return 100

    def copy_s(self):
        return 0.0

    def retain(self, priority):
        self.priority = priority

    def prefetch(self, order):
        self.queue = list(order)


@dataclass(frozen=True)
class Use:
    name: str
    at: float
    uses: int
    traffic_age: int


class CountingFile(FilePlan):
    """The agent's plan file, counting how often the agent reads it whole."""

    reads = 0

    def read(self):
        self.reads += 1
        return super().read()


def bad_plan(tmp: Path, **fields) -> Path:
    doc = {"kvwarm_plan": 2, "created_at": 1.0, "entries": [{"tenant": "acme", "token_ids": [1, 2]}], **fields}
    path = tmp / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def run_agent(node: Node, source, steps: int = 1) -> NodeAgent:
    """The agent as its thread runs it (:class:`store.serving.agent.AgentThread`): a failed step is
    logged and the next one tried, here on a clock of the test's."""
    clock = [1000.0]
    agent = NodeAgent(node, source, AgentSettings(poll_s=30.0), clock=lambda: clock[0])
    for i in range(steps):
        try:
            agent.tick() if i else agent.start()
        except Exception:  # noqa: BLE001 - what the agent's thread does with a step that raises
            pass
        clock[0] += 31.0
    return agent


def typed_attack(tmp_path: Path, fields: dict, published_fields: dict, named: str) -> None:
    """The agent follows a plan file with ``fields`` wrong: it counts one plan error naming the
    field and still warms; both readers refuse the field with a :class:`PlanError` naming it."""
    node = Node()
    agent = run_agent(node, FilePlan(bad_plan(tmp_path, **fields)))
    assert agent.figures.plan_errors == 1 and named in (agent.figures.last_error or "")
    assert node.queue == []  # the agent ran its warm-up (no plan, nothing in the fleet)
    with pytest.raises(PlanError, match=named.replace(".", r"\.")):
        parse_plan({"kvwarm_plan": 2, "created_at": 1.0, "entries": [], **fields})
    # the same field in the published plan is refused too, naming it
    from store.published_plan import parse_published

    with pytest.raises(PlanError, match=named.replace(".", r"\.")):
        parse_published({"kvwarm_published_plan": 1, "created_at": 1.0, "entries": [], **published_fields})


def test_attack_plan_with_created_at_string_is_a_counted_plan_error(tmp_path) -> None:
    typed_attack(tmp_path, {"created_at": "yesterday"}, {"created_at": "yesterday"}, "created_at")


def test_attack_plan_with_window_start_string_is_a_counted_plan_error(tmp_path) -> None:
    window = {"window": {"start": "09:00", "end": 2.0}}
    typed_attack(tmp_path, window, window, "window.start")


def test_attack_plan_with_extra_string_is_a_counted_plan_error(tmp_path) -> None:
    typed_attack(tmp_path, {"extra": "fleet_reuse"}, {"extra": "fleet_reuse"}, "extra")


def test_attack_agent_rereads_a_bad_plan_version_every_poll(tmp_path) -> None:
    source = CountingFile(bad_plan(tmp_path, created_at="yesterday"))
    agent = run_agent(Node(), source, steps=6)
    assert source.reads == 1 and agent.figures.plan_errors == 1  # that version is read once, counted once
    assert agent.figures.polls == 6


def test_attack_bad_plan_stops_the_fleet_warmup(tmp_path) -> None:
    node = Node(records=[Use("acme/" + "a" * 64, 990.0, 3, 0), Use("acme/" + "b" * 64, 980.0, 1, 0)])
    run_agent(node, FilePlan(bad_plan(tmp_path, extra="x")))
    assert node.queue == ["acme/" + "a" * 64, "acme/" + "b" * 64]  # warmed from the fleet's memory
