"""The upload backlog's order (store/serving/upload_rank.py): the agent's values first, then the oldest."""
from __future__ import annotations

import math
import random

from store.serving.fleet import Use
from store.serving.upload_rank import UNRANKED, drain_key, drain_order, merged_rank, upload_ranks, upload_value
from store.serving.urgency import PlanChain, ReuseCurve, rank


def test_a_ranking_values_each_block_at_its_odds_of_use_from_the_plan_and_the_fleet() -> None:
    plan = [PlanChain(("a/00/plan-sure", "a/00/plan-tail"), expected_hits=3.0),
            PlanChain(("a/00/plan-maybe",), expected_hits=0.2)]
    fleet = [Use("a/00/fleet-hot", at=10.0, uses=3, traffic=0, node="n2", traffic_age=0),
             Use("a/00/plan-maybe", at=10.0, uses=1, traffic=0, node="n2", traffic_age=5)]
    warm = rank(plan, fleet, curve=ReuseCurve(), held=set(), capacity=100, copy_s=0.0)
    ranks = upload_ranks(warm.wanted)
    assert ranks["a/00/plan-sure"] == ranks["a/00/plan-tail"] == 1 - math.exp(-3.0)
    assert ranks["a/00/fleet-hot"] == ReuseCurve().prob(3, 0)
    both = 1 - (1 - (1 - math.exp(-0.2))) * (1 - ReuseCurve().prob(1, 5))  # named by both: odds combine
    assert math.isclose(ranks["a/00/plan-maybe"], both)
    assert "a/00/unnamed" not in ranks


def test_values_outside_0_1_are_clamped_or_unranked() -> None:
    assert upload_value(1.5) == 1.0 and upload_value(0.25) == 0.25
    assert upload_value(float("nan")) == upload_value(-1.0) == upload_value(0.0) == UNRANKED


def test_several_agents_rankings_merge_to_the_highest_value() -> None:
    plain, chat = {"x": 0.2, "y": 0.9}, {"x": 0.6}
    assert merged_rank([plain, chat], "x") == 0.6 and merged_rank([plain, chat], "y") == 0.9
    assert merged_rank([plain, chat], "z") == UNRANKED and merged_rank([], "x") == UNRANKED


def test_ranked_blocks_drain_first_by_value_then_unranked_ones_oldest_first() -> None:
    rows = [("old", 0.0, 1.0), ("new", 0.0, 5.0), ("hot", 0.9, 9.0), ("warm", 0.3, 2.0), ("tie-b", 0.3, 2.0),
            ("mid", 0.0, 3.0)]
    order = drain_order(rows, rank=lambda r: r[1], enqueued=lambda r: r[2], name=lambda r: r[0])
    assert [r[0] for r in order] == ["hot", "tie-b", "warm", "old", "mid", "new"]


def test_the_order_is_total_and_the_same_whatever_the_input_order() -> None:
    rng = random.Random(7)
    rows = [(f"n{i:03d}", rng.choice([0.0, 0.0, 0.1, 0.5]), float(rng.randrange(5))) for i in range(200)]
    want = sorted(rows, key=lambda r: drain_key(r[1], r[2], r[0]))
    for _ in range(5):
        rng.shuffle(rows)
        assert drain_order(rows, rank=lambda r: r[1], enqueued=lambda r: r[2], name=lambda r: r[0]) == want
