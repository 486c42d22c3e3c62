"""Prewarm choices: hand-made traces for the naive and oracle orders, causality for kvwarm's."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from forecasting.ingest.traces import from_chains, read_kvwarm, read_mooncake, simulation_root
from forecasting.simulate.prewarm import (
    first_use_order,
    kvwarm_prewarm,
    naive_prewarm,
    oracle_prewarm,
    plan_blocks,
    planned_prewarm,
    ranked_prewarm,
)
from forecasting.simulate.replay import BlockIndex, PredictorConfig
from store.identity.keys import block_keys
from store.plan import Plan, PlanEntry
from tests.forecasting.simulate.hand_traces import PREWARM_CHAINS, PREWARM_TIMES, dense_ids, perturbed

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"

@pytest.fixture(scope="module")
def hand() -> BlockIndex:
    return BlockIndex.build(from_chains(PREWARM_TIMES, PREWARM_CHAINS))


@pytest.fixture(scope="module")
def mooncake() -> BlockIndex:
    return BlockIndex.build(read_mooncake(MOONCAKE))


def _orig(index: BlockIndex, blocks: np.ndarray) -> list[int]:
    return index.original[blocks].tolist()


def test_naive_prewarm_counts_requests_in_the_lookback_only(hand: BlockIndex) -> None:
    # Prewarm at request 5 (t=5) with a 3.5 s lookback: requests 2, 3, 4 (t=2..4).
    # Counts: 1 -> 3, 3 -> 1 (t=2), 2 -> 1 (t=3), 4 -> 1 (t=3), 5 -> 1 (t=4); block 9 (t=0) is out.
    blocks = _orig(hand, naive_prewarm(hand, 5, 10, 3.5))
    assert blocks[-1] == 1 and 9 not in blocks
    # Ties go to the most recently used block, kept longest: 5 (t=4) after 4 and 2 (t=3), after 3 (t=2).
    assert blocks == [3, 2, 4, 5, 1]
    assert _orig(hand, naive_prewarm(hand, 5, 2, 3.5)) == [5, 1]
    assert len(naive_prewarm(hand, 5, 0, 3.5)) == 0


def test_oracle_prewarm_keeps_the_soonest_used_longest(hand: BlockIndex) -> None:
    served = np.array([5, 6])
    # Seen before request 5 and used by 5 or 6: 1 and 3 (request 5), 2 and 4 (request 6).
    blocks = oracle_prewarm(hand, 5, served, 10)
    assert sorted(_orig(hand, blocks)) == [1, 2, 3, 4]
    assert _orig(hand, blocks)[:2] in ([2, 4], [4, 2]) and set(_orig(hand, blocks)[2:]) == {1, 3}
    # The oracle's order of its own set is first_use_order's.
    assert np.array_equal(first_use_order(hand, blocks, served), blocks)


def test_first_use_order_puts_blocks_nobody_uses_first(hand: BlockIndex) -> None:
    dense = {int(hand.original[d]): d for d in range(hand.n_unique)}
    blocks = np.array([dense[b] for b in (1, 9, 2, 5, 3)])
    ordered = _orig(hand, first_use_order(hand, blocks, np.array([5, 6])))
    assert ordered[:2] == [9, 5]  # never used by requests 5, 6: evicted first, in their given order
    assert ordered[2] == 2 and set(ordered[3:]) == {1, 3}  # 2 first used by request 6; 1, 3 by request 5


@pytest.mark.parametrize("config", [PredictorConfig(), PredictorConfig(horizon_s=60, tau_s=120),
                                    PredictorConfig(horizon_s=600, tau_s=600, refresh_s=60)])
def test_kvwarm_prewarm_sees_nothing_after_its_time_under_every_tuned_setting(mooncake: BlockIndex,
                                                                              config: PredictorConfig) -> None:
    t = 300.0
    other = BlockIndex.build(perturbed(mooncake.trace, t))
    picks = []
    for index in (mooncake, other):
        start = int(np.searchsorted(index.trace.timestamps_s, t))
        for capacity in (500, index.n_unique):  # the bench's diagnostic ranks every block seen
            blocks, scores = kvwarm_prewarm(index, start, capacity, config)
            picks.append((index.original[blocks].tolist(), np.round(scores, 9).tolist()))
    assert picks[:2] == picks[2:]
    assert len(picks[0][0]) == 500 and len(set(picks[1][1])) > 20  # a real ranking, not a constant


def test_kvwarm_prewarm_of_nothing_is_empty(mooncake: BlockIndex) -> None:
    blocks, scores = kvwarm_prewarm(mooncake, 200, 0)
    assert len(blocks) == 0 and len(scores) == 0
    blocks, _ = kvwarm_prewarm(mooncake, 0, 100)  # nothing seen before the first request
    assert len(blocks) == 0


def test_ranked_prewarm_keeps_parents_with_their_children_and_only_blocks_seen(hand: BlockIndex) -> None:
    d = dense_ids(hand)
    score = np.zeros(hand.n_unique)
    score[d[4]], score[d[9]], score[d[7]] = 10.0, -np.inf, 100.0  # 7 is first used at request 6: unseen at 5
    blocks, closed = ranked_prewarm(hand, 5, score, 3)
    assert _orig(hand, blocks) == [4, 2, 1]  # 2 and 1 raised to 4's score; the deepest goes first
    assert closed.tolist() == [10.0, 10.0, 10.0]
    everything, _ = ranked_prewarm(hand, 5, score, hand.n_unique)
    assert sorted(_orig(hand, everything)) == [1, 2, 3, 4, 5]  # 9 is no candidate, 6 and 7 unseen

# ------------------------------------------------------------------ plan prewarm


def _kvwarm_log(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sim_keys(tenant: str, tokens: list[int], block_size: int = 2) -> list[str]:
    return block_keys(simulation_root(tenant, block_size), tokens)


def test_plan_blocks_key_token_ids_like_the_trace_and_list_shared_blocks_once(tmp_path: Path) -> None:
    log = _kvwarm_log(tmp_path, [
        {"timestamp": 0, "tenant": "a", "token_ids": [1, 2, 3, 4, 5]},
        {"timestamp": 1, "tenant": "a", "token_ids": [1, 2, 7, 8]},
        {"timestamp": 2, "tenant": "b", "token_ids": [1, 2, 3, 4]},
    ])
    index = BlockIndex.build(read_kvwarm(log, block_size=2))
    names = index.trace.key_names
    dense = {names[int(o)]: i for i, o in enumerate(index.original)}
    plan = Plan((PlanEntry("a", token_ids=(1, 2, 7, 8, 9)),      # two full blocks, both in the trace
                 PlanEntry("a", token_ids=(1, 2, 3, 4)),         # shares its first block with the entry above
                 PlanEntry("b", token_ids=(1, 2, 6, 6)),         # b's root is in the trace, (6, 6) is not
                 PlanEntry("c", token_ids=(1, 2))))              # a tenant the trace never saw
    got = plan_blocks(index, plan).tolist()
    a, b = _sim_keys("a", [1, 2, 7, 8]), _sim_keys("a", [1, 2, 3, 4])
    assert got[:3] == [dense[a[0]], dense[a[1]], dense[b[1]]]
    assert got[3] == dense[_sim_keys("b", [1, 2])[0]]
    # Blocks the trace never uses get ids past the trace's, one per distinct key.
    assert got[4:] == [index.n_unique, index.n_unique + 1]
    # The cut keeps the most valuable blocks, parents with children, and loads the least valuable first.
    assert planned_prewarm(np.array(got), 3).tolist() == [dense[b[1]], dense[a[1]], dense[a[0]]]
    assert planned_prewarm(np.array(got), 0).tolist() == []


def test_plan_blocks_find_serving_keys_by_prefix_id(tmp_path: Path) -> None:
    keys = [f"{i:064x}" for i in (11, 12, 13)]
    log = _kvwarm_log(tmp_path, [{"timestamp": 0, "tenant": "a", "block_keys": keys},
                                 {"timestamp": 1, "tenant": "a", "block_keys": keys[:1]}])
    index = BlockIndex.build(read_kvwarm(log, block_size=2))
    names = index.trace.key_names
    dense = {names[int(o)]: i for i, o in enumerate(index.original)}
    # The plan's token ids were keyed with the serving model's root, which the simulation does not
    # know; its prefix_id (the key of the prefix's last full block) is in the trace.
    plan = Plan((PlanEntry("a", token_ids=(5, 5, 5, 5), prefix_id=keys[1]),))
    assert plan_blocks(index, plan).tolist() == [dense[keys[0]], dense[keys[1]]]


def test_plan_blocks_need_block_keys_and_token_ids(hand: BlockIndex, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a trace with block keys"):
        plan_blocks(hand, Plan((PlanEntry("a", token_ids=(1, 2)),)))
    index = BlockIndex.build(read_kvwarm(_kvwarm_log(tmp_path, [{"timestamp": 0, "tenant": "a",
                                                                 "token_ids": [1, 2]}]), block_size=2))
    with pytest.raises(ValueError, match=r"plan entry 1 \(tenant 'a'\) has text but no token_ids"):
        plan_blocks(index, Plan((PlanEntry("a", token_ids=(1, 2)), PlanEntry("a", text="hello"))))
