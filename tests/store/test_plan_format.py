"""The plan file's format: version 2 (retain entries, hash ids, as_of) and version 1 read as before."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from store.plan import PLAN_VERSION, Plan, PlanEntry, PlanError, parse_plan, read_plan, write_plan


def _plan() -> Plan:
    return Plan(entries=(PlanEntry("acme", token_ids=(1, 2, 3), score=2.0, expected_hits=4.0),
                         PlanEntry("acme", token_ids=(1, 2, 3, 4), action="retain", score=1.0, prefix_id="ab"),
                         PlanEntry("mooncake", hash_ids=(0, 14, 15), action="retain", score=0.5, urgency=0.25)),
                created_at=10.0, as_of=9.5, block_size=16)


@pytest.mark.parametrize("suffix", [".json", ".parquet"])
def test_a_version_2_plan_round_trips_with_its_actions_hash_ids_and_as_of(tmp_path: Path, suffix: str) -> None:
    plan = _plan()
    again = read_plan(write_plan(plan, tmp_path / f"plan{suffix}"))
    assert again.entries == plan.entries and again.as_of == 9.5
    assert [e.action for e in again.entries] == ["prefill", "retain", "retain"]
    assert [e.urgency for e in again.entries] == [None, None, 0.25]  # optional: absent reads as None


def test_the_file_says_version_2_and_leaves_the_default_action_out(tmp_path: Path) -> None:
    doc = json.loads(write_plan(_plan(), tmp_path / "plan.json").read_text())
    assert doc["kvwarm_plan"] == PLAN_VERSION == 2 and doc["as_of"] == 9.5
    assert "action" not in doc["entries"][0] and doc["entries"][2]["hash_ids"] == [0, 14, 15]


def test_a_version_1_plan_is_read_as_prefill_entries() -> None:
    plan = parse_plan({"kvwarm_plan": 1, "created_at": 1.0, "entries": [{"tenant": "acme", "text": "You are"}]})
    assert plan.entries[0].action == "prefill" and plan.as_of is None
    assert plan.prefill_entries() == list(plan.entries)


def test_only_prefill_entries_with_tokens_or_text_go_to_the_prefill_job() -> None:
    assert [e.token_ids for e in _plan().prefill_entries()] == [(1, 2, 3)]
    hashed = PlanEntry("mooncake", hash_ids=(1, 2))  # a prefill entry named by hash ids cannot be computed
    assert not hashed.prefillable and Plan(entries=(hashed,)).prefill_entries() == []


@pytest.mark.parametrize("entry, message", [
    ({"tenant": "a", "token_ids": [1], "hash_ids": [1]}, "exactly one of 'token_ids', 'text' or 'hash_ids'"),
    ({"tenant": "a", "hash_ids": [1, -2]}, "'hash_ids' must be a non-empty list of non-negative integers"),
    ({"tenant": "a", "text": "x", "action": "keep"}, "'action' must be one of prefill, retain"),
    ({"tenant": "a", "hash_ids": [1], "action": "retain", "urgency": -0.5}, "'urgency' must be a number >= 0"),
])
def test_bad_entries_name_the_field(entry: dict, message: str) -> None:
    with pytest.raises(PlanError, match="entry 0") as info:
        parse_plan({"kvwarm_plan": 2, "entries": [entry]}, "p.json")
    assert message in str(info.value)


def test_an_unknown_version_or_a_bad_as_of_is_refused() -> None:
    with pytest.raises(PlanError, match="reads versions 1, 2"):
        parse_plan({"kvwarm_plan": 3, "entries": []})
    with pytest.raises(PlanError, match="'as_of' must be Unix seconds"):
        parse_plan({"kvwarm_plan": 2, "as_of": "yesterday", "entries": []})
