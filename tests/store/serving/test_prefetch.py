"""Which plan entries a loader's prefetch turns into block chains (no store, no model)."""
from __future__ import annotations

from store.format.precision import Precision
from store.identity.keys import KeyRoot
from store.identity.tenant import Tenant
from store.plan import Plan, PlanEntry
from store.serving.fetch import Scope
from store.serving.prefetch import plan_chains


def test_prefill_and_retain_entries_are_prefetched_and_hash_id_entries_are_skipped() -> None:
    p = Precision()
    root = KeyRoot("model", "rev", p.kv_dtype, p.scheme_id(), 4, Tenant.derive("acme").salt)
    scope = Scope(root, "acme")
    plan = Plan(entries=(PlanEntry("acme", token_ids=tuple(range(8)), score=2.0),
                         PlanEntry("acme", token_ids=tuple(range(12)), action="retain", score=1.0),
                         PlanEntry("acme", hash_ids=(1, 2), action="retain"),
                         PlanEntry("acme", text="no tokenizer given"),
                         PlanEntry("other", token_ids=(1, 2, 3, 4))))
    chains, skipped = plan_chains(plan, scope, {"acme": scope}, None)
    assert [(len(c), score) for c, score, _ in chains] == [(2, 2.0), (3, 1.0)]
    assert skipped == 3
    chains, skipped = plan_chains(plan, scope, {"acme": scope}, lambda text: list(range(4)))
    assert len(chains) == 3 and skipped == 2  # with a tokenizer the text entry is keyed; hash ids never
