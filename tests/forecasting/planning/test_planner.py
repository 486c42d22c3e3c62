"""The prewarm plan: value ordering, both budgets, nesting, TTLs, and the plan file."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecasting.mining.demand import Demand
from forecasting.models.catalog import candidates
from forecasting.models.selection import forecast_frame
from forecasting.planning.accuracy import warmup_accuracy
from forecasting.planning.offpeak import lowest_window
from forecasting.planning.planner import Budget, PlanCosts, PlanPolicy, candidates_from, make_plan, select
from store.config import KvCacheConfig
from store.cost import PrefillCost
from store.plan import read_plan, write_plan
from tests.forecasting.synth import daily_means, long_table, poisson

W0 = pd.Timestamp("2025-01-01 02:00")
W1 = pd.Timestamp("2025-01-01 05:00")
HOUR = pd.Timedelta(hours=1)
COST = PlanCosts(prefill=PrefillCost.from_rate(1000.0), bytes_per_token=1000.0, gpu_s_per_gib_hour=0.0)


def _prefixes(rows: list[tuple], series: pd.DataFrame | None = None) -> Demand:
    cols = ["unique_id", "tenant", "n_tokens", "parent", "family", "token_ids", "text"]
    prefixes = pd.DataFrame(rows, columns=cols).astype({"token_ids": object, "text": object, "parent": object})
    prefixes["n_blocks"] = prefixes["n_tokens"] // 16
    prefixes["distinct_requests"] = 10
    if series is None:
        series = pd.DataFrame({"unique_id": pd.Series(dtype=object), "ds": pd.Series(dtype="datetime64[us]"),
                               "y": pd.Series(dtype=float)})
    total = series.groupby("ds", as_index=False)["y"].sum()
    return Demand(series=series, total=total, bucket=HOUR, prefixes=prefixes)


def _forecast(rates: dict[str, float], hours: int = 12, p: float | None = None) -> pd.DataFrame:
    ds = pd.date_range(W1, periods=hours, freq="h")
    return pd.concat([pd.DataFrame({"unique_id": uid, "ds": ds, "y_hat": r,
                                    "p_any": (1 - np.exp(-r)) if p is None else p}) for uid, r in rates.items()],
                     ignore_index=True)


def test_entries_are_ordered_by_value_and_carry_the_forecast(tmp_path) -> None:
    demand = _prefixes([("a", "acme", 1000, None, "f1", [1, 2, 3], None),
                        ("b", "acme", 1000, None, "f2", None, "You are b"),
                        ("c", "bolt", 1000, None, None, [4, 5], None)])
    fc = _forecast({"a": 1.0, "b": 5.0, "c": 2.0})
    plan = make_plan(demand, fc, cost=COST, budget=Budget(1e6, 1e12), window_start=W0, window_end=W1, bucket=HOUR,
                     policy=PlanPolicy(kv_cache=KvCacheConfig(ttl_min_hours=1, ttl_max_hours=4)), created_at=1.0)
    assert [e.prefix_id for e in plan.entries] == ["b", "c", "a"]
    b = plan.entries[0]
    assert b.text == "You are b" and b.token_ids is None and b.ttl_s == 4 * 3600
    assert b.expected_hits == pytest.approx(20.0)  # 5 an hour over a 4 h TTL
    assert b.score == pytest.approx(20.0 * 1.0 - 1.0)  # hits x 1 s saved - 1 s to prefill
    assert plan.window_start == W0.timestamp() and plan.window_end == W1.timestamp()
    again = read_plan(write_plan(plan, tmp_path / "plan.json"))
    assert again.entries == plan.entries


def test_both_budgets_are_respected() -> None:
    rows = [(f"p{i}", "acme", 1000 * (i + 1), None, None, [i + 1], None) for i in range(8)]
    fc = _forecast({f"p{i}": 10.0 - i for i in range(8)})
    for budget in (Budget(gpu_s=5.0, store_bytes=1e12), Budget(gpu_s=1e6, store_bytes=6e6)):
        chosen = select(candidates_from(_prefixes(rows), fc, W1, PlanPolicy(), HOUR)[0], COST, budget)
        assert chosen
        assert sum(c.gpu_s for c in chosen) <= budget.gpu_s
        assert sum(c.store_bytes for c in chosen) <= budget.store_bytes
    nothing = select(candidates_from(_prefixes(rows), fc, W1, PlanPolicy(), HOUR)[0], COST, Budget(0.5, 1e12))
    assert nothing == []


def test_storage_is_priced_in_gpu_seconds_per_gib_hour() -> None:
    cost = PlanCosts(prefill=PrefillCost.from_rate(1000.0), bytes_per_token=2**20, gpu_s_per_gib_hour=3.0)
    assert cost.bytes(1024) == 2**30 and cost.storage_s(1024, 7200) == pytest.approx(1.0 * 2 * 3.0)


def test_attention_makes_long_prefixes_cost_more_per_token() -> None:
    # One prefix of 8,000 tokens against four of 2,000, the same tokens and requests in all:
    # the long one costs more to prefill (attention) and saves as much more per hit.
    cost = PlanCosts(prefill=PrefillCost(1e-3, 1e-6), bytes_per_token=1.0, gpu_s_per_gib_hour=0.0)
    demand = _prefixes([("long", "acme", 8000, None, None, [1], None)]
                       + [(f"s{i}", "acme", 2000, None, None, [i + 2], None) for i in range(4)])
    fc = _forecast({"long": 3.0, **{f"s{i}": 3.0 for i in range(4)}})
    chosen = {c.candidate.prefix_id: c for c in select(candidates_from(demand, fc, W1, PlanPolicy(), HOUR)[0],
                                                       cost, Budget(1e6, 1e12))}
    assert chosen["long"].gpu_s == pytest.approx(8.0 + 1e-6 * 8000 * 8001 / 2)
    assert chosen["long"].gpu_s > 4 * chosen["s0"].gpu_s
    hits = chosen["long"].candidate.expected_hits
    assert chosen["long"].value == pytest.approx((hits - 1) * chosen["long"].gpu_s)


def test_a_prefix_under_a_planned_one_saves_only_its_extra_tokens() -> None:
    demand = _prefixes([("sys", "acme", 1000, None, None, [1], None),
                        ("tpl", "acme", 3000, "sys", None, [1, 2], None)])
    fc = _forecast({"sys": 10.0, "tpl": 9.0})
    chosen = {c.candidate.prefix_id: c for c in select(candidates_from(demand, fc, W1, PlanPolicy(), HOUR)[0],
                                                       COST, Budget(1e6, 1e12))}
    hits_sys, hits_tpl = chosen["sys"].candidate.expected_hits, chosen["tpl"].candidate.expected_hits
    # sys has the better value per budget and goes first; tpl then saves only its extra 2000 tokens
    assert chosen["sys"].value == pytest.approx(hits_sys * 1.0 - 1.0)
    assert chosen["tpl"].value == pytest.approx(hits_tpl * (3.0 - 1.0) - 3.0)
    # either order gives the same total: each request is served by the longest planned prefix
    total = hits_tpl * 3.0 + (hits_sys - hits_tpl) * 1.0 - 3.0 - 1.0
    assert chosen["sys"].value + chosen["tpl"].value == pytest.approx(total)


def test_ttl_follows_the_forecast_within_the_configured_bounds() -> None:
    policy = PlanPolicy(kv_cache=KvCacheConfig(ttl_min_hours=2, ttl_max_hours=6, ttl_hours=4))
    demand = _prefixes([("soon", "acme", 100, None, None, [1], None), ("long", "acme", 100, None, None, [2], None),
                        ("never", "acme", 100, None, None, [3], None)])
    fc = pd.concat([_forecast({"soon": 1.0}, hours=3, p=0.9), _forecast({"soon": 1.0}, hours=12, p=0.1).iloc[3:],
                    _forecast({"long": 1.0}, hours=12, p=0.9), _forecast({"never": 0.0}, hours=12, p=0.0)])
    ttl = {c.prefix_id: c.ttl_s for c in candidates_from(demand, fc, W1, policy, HOUR)[0]}
    assert ttl == {"soon": 3 * 3600.0, "long": 6 * 3600.0, "never": 2 * 3600.0}


def test_prefixes_without_tokens_or_text_are_skipped_and_counted() -> None:
    demand = _prefixes([("a", "acme", 1000, None, None, None, None), ("b", "acme", 1000, None, None, [1], None)])
    plan = make_plan(demand, _forecast({"a": 5.0, "b": 5.0}), cost=COST, budget=Budget(1e6, 1e12),
                     window_start=W0, window_end=W1, bucket=HOUR)
    assert [e.prefix_id for e in plan.entries] == ["b"] and plan.extra["skipped_without_tokens"] == 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bytes_per_token"):
        PlanCosts(prefill=PrefillCost(), bytes_per_token=0)
    with pytest.raises(ValueError, match="gpu_s_per_gib_hour"):
        PlanCosts(prefill=PrefillCost(), bytes_per_token=1, gpu_s_per_gib_hour=-1)
    with pytest.raises(ValueError, match="gpu_s"):
        Budget(gpu_s=-1, store_bytes=1)
    with pytest.raises(ValueError, match="ttl_p"):
        PlanPolicy(ttl_p=0.0)
    with pytest.raises(ValueError, match="not after"):
        make_plan(_prefixes([]), _forecast({"a": 1.0}), cost=COST, budget=Budget(1, 1), window_start=W1, window_end=W0,
                  bucket=HOUR)


def test_demand_to_forecast_to_plan_to_accuracy() -> None:
    # three templates with known daily demand (busy, quiet, dead) over 8 days; plan for day 8
    days = 8
    series = long_table({"busy": poisson(daily_means(days, base=30, amp=20), seed=1),
                         "quiet": poisson(daily_means(days, base=0.3, amp=0.25), seed=2),
                         "dead": np.zeros(days * 24)}, start=pd.Timestamp("2025-01-01"))
    demand = _prefixes([("busy", "acme", 2000, None, "f1", [1, 2], None), ("quiet", "acme", 2000, None, "f2", [3], None),
                        ("dead", "acme", 2000, None, "f3", [4], None)], series)
    cut = pd.Timestamp("2025-01-01") + pd.Timedelta(days=days - 1)
    history = demand.series[demand.series["ds"] < cut]
    fc = forecast_frame(history, candidates, 24)
    total_fc = fc.groupby("ds")["y_hat"].sum()
    window = lowest_window(total_fc, 3)
    assert window.start.hour in (2, 3, 4)  # the known trough is at 04:00
    cost = PlanCosts(prefill=PrefillCost().scaled(2000.0), bytes_per_token=1000.0)
    plan = make_plan(demand, fc, cost=cost, budget=Budget(gpu_s=1e4, store_bytes=1e12), window_start=window.start,
                     window_end=window.end, bucket=HOUR)
    assert [e.prefix_id for e in plan.entries] == ["busy"]  # quiet and dead cost more than they save
    observed = demand.series[demand.series["ds"] >= cut]
    acc = warmup_accuracy(plan, observed, total_requests=float(observed["y"].sum()))
    assert acc.precision == 1.0 and acc.recall > 0.95
