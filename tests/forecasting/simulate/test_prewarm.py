"""A plan's blocks on the trace, a mined tree's nodes on the trace, and the oracle's prefetch."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from forecasting.ingest.log_trace import requests_from_trace, trace_from_requests
from forecasting.ingest.traces import from_chains, read_kvwarm, simulation_root
from forecasting.mining.request_tree import mine_requests
from forecasting.simulate.prewarm import oracle_prewarm, plan_blocks, plan_priorities, tree_blocks
from forecasting.simulate.replay import BlockIndex
from store.identity.keys import block_keys
from store.plan import Plan, PlanEntry
from tests.forecasting.simulate.hand_traces import PREWARM_CHAINS, PREWARM_TIMES


@pytest.fixture(scope="module")
def hand() -> BlockIndex:
    return BlockIndex.build(from_chains(PREWARM_TIMES, PREWARM_CHAINS))


def _orig(index: BlockIndex, blocks: np.ndarray) -> list[int]:
    return index.original[blocks].tolist()


def test_the_oracle_fetches_in_first_use_order_only_what_can_land_in_time(hand: BlockIndex) -> None:
    stored = np.zeros(hand.n_unique, dtype=np.int64)  # everything in S3 from the start
    served = np.arange(3, 7)  # requests at 3..6 s use 1, 2, 4 (at 3 s), 5 (4 s), 3, 6 (5 s), 7 (6 s) first
    # A copy every 0.5 s from 3 s: nothing lands by 3 s, so 1, 2 and 4 are skipped; 5 lands at 3.5 s,
    # 3 at 4 s, 6 at 4.5 s and 7 at 5 s, each by its first use.
    got = _orig(hand, oracle_prewarm(hand, 3, served, stored, capacity=10, fetch_s=0.5))
    assert got == [5, 3, 6, 7]
    assert _orig(hand, oracle_prewarm(hand, 3, served, stored, capacity=2, fetch_s=0.5)) == [5, 3]
    late = stored.copy()
    late[hand.original == 6] = 99  # not stored yet: no prewarm can have it
    assert 6 not in _orig(hand, oracle_prewarm(hand, 3, served, late, capacity=10, fetch_s=0.5))
    held = {int(np.flatnonzero(hand.original == 5)[0])}
    assert 5 not in _orig(hand, oracle_prewarm(hand, 3, served, stored, capacity=10, fetch_s=0.5, skip=held))


def test_hash_id_entries_name_a_mooncake_traces_blocks_and_priorities_take_the_best_entry(hand: BlockIndex) -> None:
    plan = Plan((PlanEntry("t", hash_ids=(1, 2, 4), action="retain", score=3.0),
                 PlanEntry("t", hash_ids=(1, 3), action="retain", score=2.0),
                 PlanEntry("t", hash_ids=(1, 77), action="retain", score=1.0)))
    order, priority = plan_priorities(hand, plan)
    assert _orig(hand, order[order < hand.n_unique]) == [1, 2, 4, 3]
    assert order[-1] == hand.n_unique  # 77 is not in the trace: it takes room and never hits
    where = {int(o): i for i, o in enumerate(hand.original)}
    assert priority[where[1]] == 3.0 and priority[where[3]] == 2.0


def test_a_mined_trees_nodes_are_the_traces_blocks() -> None:
    trace = from_chains(PREWARM_TIMES, PREWARM_CHAINS, block_tokens=4)
    index = BlockIndex.build(trace)
    tree = mine_requests(requests_from_trace(trace), block_size=4)
    dense = tree_blocks(index, tree)
    for node in range(tree.n_nodes):
        assert index.original[dense[node]] == tree.prefix_values(node)[-1]
    # a log of token ids: the tree's store keys are the trace's keys
    rows = pd.DataFrame({"timestamp": pd.to_datetime([0, 1], unit="s"), "tenant": ["a", "a"], "model": "m",
                         "token_ids": [np.arange(6), np.arange(4)]})
    logged = BlockIndex.build(trace_from_requests(rows, block_size=2))
    tree = mine_requests(rows, block_size=2, roots={"a": simulation_root("a", 2)})
    dense = tree_blocks(logged, tree)
    assert sorted(dense.tolist()) == list(range(logged.n_unique))


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


def test_plan_blocks_need_block_keys_for_token_ids_and_refuse_text(hand: BlockIndex, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a trace with block keys"):
        plan_blocks(hand, Plan((PlanEntry("a", token_ids=(1, 2)),)))
    index = BlockIndex.build(read_kvwarm(_kvwarm_log(tmp_path, [{"timestamp": 0, "tenant": "a",
                                                                 "token_ids": [1, 2]}]), block_size=2))
    with pytest.raises(ValueError, match=r"tenant 'a' has text but no token_ids"):
        plan_blocks(index, Plan((PlanEntry("a", token_ids=(1, 2)), PlanEntry("a", text="hello"))))
