"""A node agent warms exactly the same from the published plan (salted keys) as from the plan
with the prompts: the same blocks, in the same order, the same mapped ahead."""
from __future__ import annotations

from pathlib import Path

from store.identity.keys import KeyRoot
from store.identity.tenant import PUBLIC, PUBLIC_TENANT, Tenant
from store.plan import Plan, PlanEntry
from store.published_plan import PublishedPlan, key_plan, root_id
from store.serving.agent import AgentSettings, NodeAgent
from store.serving.loader import KVLoader
from store.serving.loader_node import LoaderNode
from store.tiers.store import Store
from tests.store.pool_workers import ACME, TINY, config, prompt, synthetic_prefix

BS = 16
BOLT = Tenant.derive("bolt", "bolt-secret-long-enough-for-any-minimum-0123456789")


def encode(text: str, chat: bool = False) -> list[int]:
    """The node's tokenizer and the pipeline's (the same, as the same model's are)."""
    return [b % 384 for b in text.encode("utf-8")]


class Once:
    """A plan source holding one plan."""

    def __init__(self, plan: Plan | PublishedPlan) -> None:
        self.plan = plan

    def version(self) -> str:
        return "1"

    def read(self) -> Plan | PublishedPlan:
        return self.plan


def the_plan() -> Plan:
    """Every kind of entry a plan holds: stored and missing prefixes, text, public, another tenant's,
    hash ids, a chat entry, one shorter than a block, retain entries with urgency."""
    text = "You are a helpful assistant of ACME. Answer briefly and cite sources." * 2
    return Plan(entries=(
        PlanEntry("acme", token_ids=tuple(prompt(3 * BS, seed=1)), score=5.0, expected_hits=4.0),
        PlanEntry("bolt", token_ids=tuple(prompt(2 * BS, seed=2)), score=4.5, expected_hits=3.0),
        PlanEntry("public", token_ids=tuple(prompt(2 * BS + 3, seed=3)), score=4.0, expected_hits=2.5),
        PlanEntry("acme", text=text, score=3.5, expected_hits=2.0),
        PlanEntry("acme", hash_ids=(1, 2, 3), action="retain", score=3.0),
        PlanEntry("acme", token_ids=tuple(prompt(BS - 1, seed=4)), score=2.5),
        PlanEntry("acme", token_ids=tuple(prompt(2 * BS, seed=5)), chat=True, score=2.0),
        PlanEntry("acme", token_ids=tuple(prompt(4 * BS, seed=6)), action="retain", urgency=0.7, score=1.5,
                  expected_hits=0.8),
        PlanEntry("acme", token_ids=tuple(prompt(BS, seed=1)) + tuple(prompt(BS, seed=9)), action="retain",
                  score=1.0, expected_hits=0.5),  # shares its first block with the first entry
    ), created_at=1.0, block_size=BS, extra={"horizon_s": 600.0, "kv_bytes_per_token": 128.0})


def pipeline_roots(cfg) -> callable:
    """The roots the pipeline keys with: the model's, the config's precision, each tenant's salt."""
    salts = {"acme": ACME.salt, "bolt": BOLT.salt, PUBLIC: PUBLIC_TENANT.salt}

    def root_for(tenant: str, chat: bool) -> KeyRoot | None:
        return None if chat else TINY.key_root(cfg.kv_cache.precision(), BS, salts[tenant])
    return root_for


def warm_up(tmp: Path, name: str, plan: Plan | PublishedPlan) -> tuple[list[str], dict[str, float], object]:
    """A fresh node (its NVMe holding the first and the public prefix) warmed by ``plan``."""
    cfg = config(BS, "bf16")
    url = f"file://{tmp}/{name}"
    store = Store.open(url, cfg)
    first, public = the_plan().entries[0], the_plan().entries[2]
    synthetic_prefix(store, cfg, first.token_ids, layers=2, heads=2, head_dim=16)
    synthetic_prefix(store, cfg, public.token_ids, layers=2, heads=2, head_dim=16, tenant=PUBLIC_TENANT)
    store.close()
    results = []
    with KVLoader(url, tenant=ACME, model=TINY, pool_bytes=64 << 20, config=cfg, pool_dir=tmp / f"{name}-pool") as ld:
        node = LoaderNode(ld, tokenizer=encode, on_result=results.append)
        agent = NodeAgent(node, Once(plan), AgentSettings(fleet_memory=False), clock=lambda: 1000.0)
        warm = agent.start()
        assert ld.prefetcher.wait_idle(60)
        assert agent.figures.plan_errors == 0
    return warm.order, warm.priority, results[-1]


def test_the_published_plan_warms_the_same_blocks_in_the_same_order_as_the_plan_with_prompts(tmp_path) -> None:
    plan = the_plan()
    cfg = config(BS, "bf16")
    keyed = key_plan(plan, pipeline_roots(cfg), encode)
    assert keyed.extra["unpublished"] == {"hash_ids": 1, "short": 1, "no_root": 1}
    old_order, old_priority, old = warm_up(tmp_path, "old", plan)
    new_order, new_priority, new = warm_up(tmp_path, "new", keyed)
    assert old_order and new_order == old_order and new_priority == old_priority
    assert (new.present, new.mapped, new.prefixes) == (old.present, old.mapped, old.prefixes)
    # the stored prefixes mapped ahead (from their headers' tokens): 3 + 2 blocks, and the head the last shares
    assert new.mapped == 3 + 2 + 1


def test_entries_keyed_under_another_root_are_skipped_and_counted(tmp_path) -> None:
    cfg = config(BS, "bf16")
    other = lambda tenant, chat: TINY.key_root(cfg.kv_cache.precision(), BS, BOLT.salt)  # noqa: E731 - a wrong salt
    keyed = key_plan(Plan(entries=(PlanEntry("acme", token_ids=tuple(prompt(2 * BS))),)), other)
    url = f"file://{tmp_path}/nvme"
    skipped = []
    with KVLoader(url, tenant=ACME, model=TINY, pool_bytes=8 << 20, config=cfg, pool_dir=tmp_path / "pool") as ld:
        node = LoaderNode(ld, on_skipped=skipped.append)
        assert keyed.entries[0].root != root_id(ld.root)
        assert node.plan_chains(keyed) == [] and node.root_skipped == 1 and skipped == [1]
