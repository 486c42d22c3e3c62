"""Short-cadence plans: what the pipeline ships and the replay measures. Causality first."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forecasting.ingest.log_trace import requests_from_trace
from forecasting.ingest.traces import read_mooncake, simulation_root
from forecasting.planning.cadence import CadenceSpec, plan_now, unix_s
from forecasting.planning.planner import PlanCosts
from forecasting.planning.retain import RetainBudget
from forecasting.planning.reuse import ReuseConfig
from store.cost import PrefillCost
from store.identity.keys import block_keys
from store.plan import Plan, PlanEntry

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"
COST = PlanCosts(PrefillCost(), bytes_per_token=67587.875, gpu_s_per_gib_fetched=0.0)
SPEC = CadenceSpec(RetainBudget(node_bytes=2000 * 512 * 67587.875), ReuseConfig(horizon_s=60.0, min_outcomes=100))


@pytest.fixture(scope="module")
def requests() -> pd.DataFrame:
    return requests_from_trace(read_mooncake(MOONCAKE), origin=pd.Timestamp("2026-03-02"))


def _perturbed(requests: pd.DataFrame, after: pd.Timestamp) -> pd.DataFrame:
    """Every request from ``after`` on replaced: other chains, other times, other counts."""
    out = requests.copy()
    late = out["timestamp"] >= after
    rng = np.random.default_rng(1)
    out.loc[late, "hash_ids"] = pd.Series([rng.integers(0, 50, size=int(rng.integers(1, 30))) for _ in range(late.sum())],
                                          index=out.index[late], dtype=object)
    out.loc[late, "timestamp"] = (after + pd.to_timedelta(np.round(rng.uniform(0, 300, late.sum()), 3), unit="s")
                                  ).astype("datetime64[us]")
    out.loc[late, "prompt_tokens"] = 512
    return out


@pytest.mark.parametrize("minutes", [2, 5])
def test_perturbing_the_logs_after_a_plans_time_changes_nothing_in_it(requests: pd.DataFrame, minutes: int) -> None:
    as_of = pd.Timestamp("2026-03-02") + pd.Timedelta(minutes=minutes)
    plan = plan_now(requests, as_of, cost=COST, spec=SPEC, block_size=512, created_at=0.0)
    again = plan_now(_perturbed(requests, as_of), as_of, cost=COST, spec=SPEC, block_size=512, created_at=0.0)
    assert plan.entries and again == plan
    assert plan.as_of == unix_s(as_of) and all(e.action == "retain" and e.hash_ids for e in plan.entries)
    # ...while what the plan did see matters: perturbing before its time changes it
    early = plan_now(_perturbed(requests, as_of - pd.Timedelta(seconds=90)), as_of, cost=COST, spec=SPEC,
                     block_size=512, created_at=0.0)
    assert early.entries != plan.entries


def test_a_plan_learns_from_its_lookback_only_and_orders_entries_by_urgency(requests: pd.DataFrame) -> None:
    as_of = pd.Timestamp("2026-03-02") + pd.Timedelta(minutes=6)
    short = CadenceSpec(SPEC.budget, SPEC.reuse, lookback_s=60.0, lookback_requests=0)
    plan = plan_now(requests, as_of, cost=COST, spec=short, block_size=512, created_at=0.0)
    seen = requests[(requests["timestamp"] < as_of) & (requests["timestamp"] >= as_of - pd.Timedelta(seconds=60))]
    assert plan.extra["requests"] == len(seen) and plan.extra["reuse"]["fallback"]  # 60 s: no outcome closed yet
    assert "read_s" not in plan.extra and plan.extra["retain_blocks"] <= 2000
    # the fallback's urgency is its recency and frequency, scaled to the short window
    urgency = [e.urgency for e in plan.entries]
    assert urgency == sorted(urgency, reverse=True)
    assert all(u <= e.expected_hits * SPEC.reuse.urgent_s / SPEC.reuse.horizon_s + 1e-6
               for u, e in zip(urgency, plan.entries))


def test_retain_entries_are_copied_most_urgent_first(requests: pd.DataFrame) -> None:
    as_of = pd.Timestamp("2026-03-02") + pd.Timedelta(minutes=6)
    plan = plan_now(requests, as_of, cost=COST, spec=SPEC, block_size=512, created_at=0.0)
    assert not plan.extra["reuse"]["fallback"]
    urgency = [e.urgency for e in plan.entries]
    assert all(u is not None and 0 <= u <= 1 for u in urgency)
    assert urgency == sorted(urgency, reverse=True)
    assert [e.score for e in plan.entries] != sorted((e.score for e in plan.entries), reverse=True)  # it differs
    by_value = plan_now(requests, as_of, cost=COST, spec=CadenceSpec(SPEC.budget, SPEC.reuse, urgent_first=False),
                        block_size=512, created_at=0.0)
    assert [e.score for e in by_value.entries] == sorted((e.score for e in plan.entries), reverse=True)
    assert set(by_value.entries) == set(plan.entries)  # the same set, the budget's: only the order changed


def test_after_an_idle_gap_a_plan_keeps_what_it_held_when_traffic_stopped(requests: pd.DataFrame) -> None:
    stop = pd.Timestamp("2026-03-02") + pd.Timedelta(minutes=6)
    before = requests[requests["timestamp"] < stop]
    # once every outcome is closed (a horizon after the last request), waiting changes nothing
    closed = stop + pd.Timedelta(seconds=SPEC.reuse.horizon_s + 1)
    right_after = plan_now(before, closed, cost=COST, spec=SPEC, block_size=512, created_at=0.0)
    hours_later = stop + pd.Timedelta(hours=9)
    late = plan_now(before, hours_later, cost=COST, spec=SPEC, block_size=512, created_at=0.0)
    assert late.extra["requests"] == len(before) and late.extra["read_s"] > 9 * 3600
    assert right_after.entries and [e.hash_ids for e in late.entries] == [e.hash_ids for e in right_after.entries]
    assert [e.expected_hits for e in late.entries] == [e.expected_hits for e in right_after.entries]
    # the lookback in requests is what reaches back: without it, nothing is left to plan from
    none = plan_now(before, hours_later, cost=COST, spec=CadenceSpec(SPEC.budget, SPEC.reuse, lookback_requests=0),
                    block_size=512, created_at=0.0)
    assert none.extra["requests"] == 0 and not none.entries


def test_the_latest_off_peak_plans_prefill_entries_stay_in_the_plan(requests: pd.DataFrame) -> None:
    as_of = pd.Timestamp("2026-03-02") + pd.Timedelta(minutes=4)
    base = Plan(entries=(PlanEntry("mooncake", token_ids=(1, 2, 3), score=1e6, prefix_id="daily"),
                         PlanEntry("mooncake", token_ids=(4, 5), score=-1.0, prefix_id="cheap")),
                window_start=10.0, window_end=20.0)
    plan = plan_now(requests, as_of, cost=COST, spec=SPEC, block_size=512, base=base, created_at=0.0)
    assert plan.entries[0].prefix_id == "daily" and plan.entries[-1].prefix_id == "cheap"
    assert plan.window_end == 20.0 and len(plan.prefill_entries()) == 2
    empty = plan_now(requests.iloc[:0], as_of, cost=COST, spec=SPEC, block_size=512, base=base, created_at=0.0)
    assert [e.prefix_id for e in empty.entries] == ["daily", "cheap"]


def test_token_logs_give_token_entries_keyed_like_the_trace() -> None:
    start = pd.Timestamp("2026-03-02")
    shared = list(range(100, 108))  # two blocks of 4 tokens
    rows = pd.DataFrame({"timestamp": [start + pd.Timedelta(seconds=s) for s in (0, 5, 10)],
                         "tenant": ["acme"] * 3, "model": ["m"] * 3,
                         "token_ids": [np.array(shared + [1, 2, 3, 4]), np.array(shared + [5, 6, 7, 8]),
                                       np.array(shared)]})
    root = simulation_root("acme", 4)
    plan = plan_now(rows, start + pd.Timedelta(seconds=20), cost=PlanCosts(PrefillCost(), 1.0),
                    spec=CadenceSpec(RetainBudget(1e9)), block_size=4, roots={"acme": root}, created_at=0.0)
    assert {e.token_ids[:8] for e in plan.entries} == {tuple(shared)}
    keys = {e.prefix_id for e in plan.entries}
    assert keys <= {block_keys(root, list(e.token_ids))[-1] for e in plan.entries}


def test_a_plan_for_one_model_learns_from_that_models_requests_only(requests: pd.DataFrame) -> None:
    as_of = pd.Timestamp("2026-03-02") + pd.Timedelta(minutes=6)
    lookback = CadenceSpec(SPEC.budget, SPEC.reuse, lookback_s=60.0, lookback_requests=300)
    ours = requests.assign(model="ours")
    plan = plan_now(ours, as_of, cost=COST, spec=lookback, block_size=512, model="ours", created_at=0.0)
    assert plan.entries and plan.model == "ours"
    # another model's requests in the log (later ones, so they fill the lookback in requests) change nothing
    theirs = requests.assign(model="theirs", timestamp=requests["timestamp"] + pd.Timedelta(seconds=30))
    both = pd.concat([ours, theirs], ignore_index=True).sort_values("timestamp", kind="stable")
    mixed = plan_now(both, as_of, cost=COST, spec=lookback, block_size=512, model="ours", created_at=0.0)
    assert mixed == plan
    # a model the log does not hold: nothing learned, and the plan says so (not the log's other requests)
    other = plan_now(ours, as_of, cost=COST, spec=lookback, block_size=512, model="absent", created_at=0.0)
    assert other.extra["requests"] == 0 and not other.entries
