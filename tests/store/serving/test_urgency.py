"""The node agent's ranking: plan forecast and fleet memory in one order, sized to the node."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from store.errors import ConfigError
from store.serving.urgency import PlanChain, ReuseCurve, plan_p, rank


@dataclass(frozen=True)
class U:
    name: str
    at: float
    uses: int
    traffic_age: int


CURVE = ReuseCurve()


def test_plan_chains_go_by_expected_uses_head_first():
    plan = [PlanChain(("a0", "a1"), expected_hits=0.5), PlanChain(("b0", "b1", "b2"), expected_hits=3.0)]
    warm = rank(plan, [], curve=CURVE, held=set(), capacity=100, copy_s=0.0)
    assert warm.order == ["b0", "b1", "b2", "a0", "a1"]
    assert warm.priority["b0"] == pytest.approx(plan_p(3.0))
    assert warm.sources() == {"plan": 5, "fleet": 0, "both": 0}


def test_held_blocks_cost_no_copy_but_count_against_capacity():
    plan = [PlanChain(("a0", "a1", "a2"), expected_hits=2.0), PlanChain(("b0",), expected_hits=1.0)]
    warm = rank(plan, [], curve=CURVE, held={"a0"}, capacity=3, copy_s=0.0)
    assert warm.order == ["a1", "a2"]
    assert [w.name for w in warm.wanted] == ["a0", "a1", "a2"]
    assert warm.dropped == 1 and "b0" not in warm.priority


def test_copies_stop_when_they_would_land_too_late():
    # a block wanted with p = 0.5 in 300 s is used at a rate of ln 2 / 300 a second; a copy landing
    # after t keeps p * exp(-rate t): with 100 s a copy, the 20th lands at 2000 s, worth 0.5 * 2^-6.7
    plan = [PlanChain(tuple(f"x{i}" for i in range(40)), expected_hits=math.log(2))]
    warm = rank(plan, [], curve=CURVE, held=set(), capacity=1000, copy_s=100.0, min_value=0.02)
    rate = math.log(2) / 300
    kept = len(warm.order)
    assert 0.5 * math.exp(-rate * kept * 100.0) >= 0.02 > 0.5 * math.exp(-rate * (kept + 1) * 100.0)
    assert warm.dropped == 40 - kept
    free = rank(plan, [], curve=CURVE, held=set(), capacity=1000, copy_s=0.0)
    assert len(free.order) == 40


def test_fleet_records_rank_by_uses_and_traffic_age_not_wall_clock():
    uses = [U("old-busy", at=0.0, uses=5, traffic_age=3), U("new-once", at=9e4, uses=1, traffic_age=5000),
            U("mid", at=5e4, uses=2, traffic_age=50)]
    warm = rank([], uses, curve=CURVE, held=set(), capacity=10, copy_s=0.0)
    # hours of silence since "old-busy" was used: no traffic since, so it is still the most likely
    assert warm.order == ["old-busy", "mid", "new-once"]
    assert warm.sources() == {"plan": 0, "fleet": 3, "both": 0}


def test_a_block_named_by_both_sources_combines_their_odds():
    plan = [PlanChain(("s",), expected_hits=plan_p(0.0) + math.log(2))]  # p 0.5
    uses = [U("s", at=1.0, uses=1, traffic_age=0)]
    warm = rank(plan, uses + [U("f", at=1.0, uses=1, traffic_age=0)], curve=CURVE, held=set(), capacity=10,
                copy_s=0.0)
    assert "f" in warm.order and "f" not in warm.priority  # copied, not pinned
    p_fleet = CURVE.prob(1, 0)
    assert warm.priority["s"] == pytest.approx(1 - 0.5 * (1 - p_fleet))
    assert warm.wanted[0].source == "both"


def test_entries_without_a_forecast_are_an_even_bet_in_the_plans_order():
    plan = [PlanChain(("p0", "p1"), expected_hits=0.0), PlanChain(("q0",), expected_hits=0.0)]
    uses = [U("f", at=1.0, uses=1, traffic_age=20000), U("g", at=1.0, uses=3, traffic_age=0)]
    warm = rank(plan, uses, curve=CURVE, held=set(), capacity=10, copy_s=0.0, min_value=0.0)
    assert warm.order == ["g", "p0", "p1", "q0", "f"]  # g: 0.7 > 0.5 > f: 0.02
    assert warm.priority["p0"] == 0.5


def test_ties_go_to_the_most_recently_used():
    uses = [U("a", at=1.0, uses=1, traffic_age=0), U("b", at=2.0, uses=1, traffic_age=0)]
    assert rank([], uses, curve=CURVE, held=set(), capacity=10, copy_s=0.0).order == ["b", "a"]


def test_curve_round_trips_and_refuses_bad_documents():
    c = ReuseCurve(horizon_s=120.0, traffic_edges=(5, 50), p=((0.2, 0.1, 0.0), (0.5, 0.3, 0.1)))
    assert ReuseCurve.from_json(c.to_json()) == c
    assert c.prob(1, 4) == 0.2 and c.prob(1, 5) == 0.1 and c.prob(7, 10**6) == 0.1
    with pytest.raises(ConfigError, match="traffic_edges"):
        ReuseCurve(traffic_edges=(5, 5), p=((0.1, 0.1, 0.1),))
    with pytest.raises(ConfigError, match="rows of 3"):
        ReuseCurve(traffic_edges=(5, 50), p=((0.1, 0.1),))
    with pytest.raises(ConfigError, match="probabilities"):
        ReuseCurve(traffic_edges=(5,), p=((0.1, 1.5),))
    with pytest.raises(ConfigError, match="fleet_reuse"):
        ReuseCurve.from_json({"p": []})
