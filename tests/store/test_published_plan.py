"""The published plan (block keys, no prompts), its checks, and the run directory's sealed entries."""
from __future__ import annotations

import dataclasses
import json

import pytest

from store.identity.keys import block_keys
from store.plan import Plan, PlanEntry, PlanError, decode_json, read_bounded, read_plan, write_plan
from store.plan_seal import open_plan, seal_plan
from store.published_plan import key_plan, parse_published, root_id
from tests.store.factories import ACME, BOLT, make_root

KEY = bytes(range(32))


def test_entries_are_keyed_under_their_tenants_root_and_only_what_a_node_uses_is_published() -> None:
    roots = {"acme": make_root(ACME), "bolt": make_root(BOLT)}
    plan = Plan(entries=(PlanEntry("acme", token_ids=tuple(range(40)), score=2.0, ttl_s=60.0),
                         PlanEntry("bolt", text="abcdefghijklmnopqrstuvwxyz", action="retain", urgency=0.5)),
                created_at=5.0, extra={"budget_gpu_s": 9.0, "horizon_s": 300.0, "kv_bytes_per_token": 2.0})
    keyed = key_plan(plan, lambda t, chat: roots[t], lambda text, chat: [ord(c) for c in text])
    a, b = keyed.entries
    assert a.keys == tuple(block_keys(roots["acme"], list(range(40)))) and a.root == root_id(roots["acme"])
    assert (a.blocks, a.bytes, a.ttl_s, a.score) == (2, 2 * 16 * 2, 60.0, 2.0)
    assert b.namespace == "bolt" and b.action == "retain" and b.urgency == 0.5 and b.blocks == 1
    assert keyed.extra == {"horizon_s": 300.0}  # the budgets stay in the run directory
    assert parse_published(json.loads(json.dumps(keyed.to_json()))) == keyed


@pytest.mark.parametrize("entry, named", [
    ({"namespace": "acme", "root": "0" * 32, "keys": ["A" * 64]}, "'keys'"),
    ({"namespace": "acme", "root": "xyz", "keys": ["a" * 64]}, "'root'"),
    ({"namespace": "acme", "root": "0" * 32, "keys": ["a" * 64], "score": True}, "'score'"),
    ({"namespace": "acme", "root": "0" * 32, "keys": ["a" * 64], "bytes": -1}, "'bytes'"),
    ({"namespace": "acme", "root": "0" * 32, "keys": ["a" * 64], "text": "hi"}, "only"),
    ({"namespace": ["acme"], "root": "0" * 32, "keys": ["a" * 64]}, "'namespace'"),
])
def test_a_bad_published_entry_is_a_plan_error_naming_the_field(entry: dict, named: str) -> None:
    with pytest.raises(PlanError, match=named):
        parse_published({"kvwarm_published_plan": 1, "created_at": 1.0, "entries": [entry]})


def test_a_plan_with_prompts_is_not_read_as_a_published_plan() -> None:
    with pytest.raises(PlanError, match="private plan"):
        parse_published({"kvwarm_plan": 2, "entries": []})


def test_a_plan_file_above_the_cap_is_refused_before_it_is_read(tmp_path) -> None:
    path = write_plan(Plan(entries=(PlanEntry("acme", token_ids=(1, 2)),)), tmp_path / "plan.json")
    with pytest.raises(PlanError, match="above the 10-byte limit"):
        read_bounded(path, cap=10)
    with pytest.raises(PlanError, match="above the 10-byte limit"):
        decode_json(path.read_bytes(), "plan", cap=10)


@pytest.mark.parametrize("doc, named", [
    ({"entries": {"tenant": "acme"}}, "'entries' must be a list"),
    ({"created_at": float("nan"), "entries": []}, "created_at"),
    ({"created_at": True, "entries": []}, "created_at"),
    ({"block_size": 1.5, "entries": []}, "block_size"),
    ({"entries": [{"tenant": "acme", "token_ids": [1], "chat": "yes"}]}, "'chat'"),
    ({"entries": [{"tenant": "acme", "token_ids": [1], "score": "high"}]}, "'score'"),
    ({"entries": [{"tenant": "acme", "token_ids": [1], "family": 12}]}, "'family'"),
    ({"entries": [{"tenant": "acme", "token_ids": [True]}]}, "'token_ids'"),
    ({"window": [1, 2], "entries": []}, "'window'"),
])
def test_a_plan_of_the_wrong_types_is_a_plan_error_naming_the_field(tmp_path, doc: dict, named: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"kvwarm_plan": 2, **doc}))
    with pytest.raises(PlanError, match=named):
        read_plan(path)


def test_sealed_entries_open_with_their_tenants_key_only(tmp_path) -> None:
    plan = Plan(entries=(PlanEntry("acme", text="a secret prompt", score=1.0), PlanEntry("bolt", token_ids=(1, 2))))
    keys = {"acme": KEY}
    sealed = seal_plan(plan, keys.get)
    assert sealed.entries[0].sealed and sealed.entries[0].text is None and sealed.entries[1] == plan.entries[1]
    again = read_plan(write_plan(sealed, tmp_path / "plan.json"))
    assert b"secret" not in (tmp_path / "plan.json").read_bytes() and again.prefill_entries() == [plan.entries[1]]
    assert open_plan(again, keys.get) == plan
    with pytest.raises(PlanError, match="tenant 'acme'"):
        open_plan(again, {}.get)  # no key here
    moved = dataclasses.replace(again, entries=(dataclasses.replace(again.entries[0], tenant="bolt"),))
    with pytest.raises(PlanError, match="cannot be opened"):
        open_plan(moved, {"bolt": KEY}.get)  # another tenant's entry, even under the same key
