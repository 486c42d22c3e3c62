"""Retained prefixes: whole chains only, ranked by their value per block, within the budgets."""
from __future__ import annotations

import numpy as np
import pytest

from forecasting.mining.prefix_tree import PrefixTree, mine_hash_ids
from forecasting.planning.planner import PlanCosts, prefix_value
from forecasting.planning.retain import (
    RetainBudget,
    available,
    closed_under_prefix,
    path_mean,
    retain_entries,
    retain_nodes,
)
from store.cost import PrefillCost
from store.errors import BadInputError

B = 4
COST = PlanCosts(PrefillCost(s_per_token=1.0, s_per_token_pair=0.0), bytes_per_token=1.0, gpu_s_per_gib_hour=0.0,
                 gpu_s_per_gib_fetched=0.0)


def _tree() -> PrefixTree:
    # Root 1; branch 1-2-3 (a conversation) and 1-4 (another); 9 a separate root.
    chains = [[1, 2, 3], [1, 4], [9]]
    ids = np.array([b for c in chains for b in c], dtype=np.int64)
    return mine_hash_ids(np.arange(3, dtype=np.int64), ids, np.array([0, 3, 5, 6]), block_size=B)


def _node(tree: PrefixTree, last: int) -> int:
    return next(int(n) for n in range(tree.n_nodes) if int(tree.prefix_values(n)[-1]) == last)


def test_a_chain_ranks_at_its_mean_value_per_block_and_parents_rank_at_least_as_high() -> None:
    tree = _tree()
    value = np.zeros(tree.n_nodes)
    for last, v in ((1, 1.0), (2, 0.0), (3, 5.0), (4, 1.5), (9, 0.5)):
        value[_node(tree, last)] = v
    mean = path_mean(tree, value)
    assert mean[_node(tree, 3)] == pytest.approx(2.0) and mean[_node(tree, 4)] == pytest.approx(1.25)
    rank = closed_under_prefix(tree, mean)
    assert rank[_node(tree, 1)] == pytest.approx(2.0) and rank[_node(tree, 2)] == pytest.approx(2.0)
    held = np.ones(tree.n_nodes, dtype=bool)
    held[_node(tree, 2)] = False
    ok = available(tree, held)
    assert not ok[_node(tree, 3)] and ok[_node(tree, 4)]  # a block whose parent is gone cannot hit


def test_the_budget_takes_whole_prefixes_in_rank_order() -> None:
    tree = _tree()
    uses = np.zeros(tree.n_nodes)
    for last, u in ((1, 0.9), (2, 0.8), (3, 0.8), (4, 0.1), (9, 0.05)):
        uses[_node(tree, last)] = u
    one_block = COST.bytes(B)
    chosen, rank = retain_nodes(tree, uses, COST, RetainBudget(node_bytes=3 * one_block), horizon_s=60.0)
    assert [int(tree.prefix_values(n)[-1]) for n in chosen] == [1, 2, 3]
    assert list(rank) == sorted(rank, reverse=True)
    entries = retain_entries(tree, uses, chosen, rank)
    assert [e.hash_ids for e in entries] == [(1, 2, 3)] and entries[0].action == "retain"  # one entry per branch
    everything, _ = retain_nodes(tree, uses, COST, RetainBudget(node_bytes=1e9), horizon_s=60.0)
    assert len(everything) == tree.n_nodes
    entries = retain_entries(tree, uses, everything, _)
    assert [e.hash_ids for e in entries] == [(1, 2, 3), (1, 4), (9,)]
    absent = np.ones(tree.n_nodes, dtype=bool)
    absent[_node(tree, 1)] = False
    kept, _ = retain_nodes(tree, uses, COST, RetainBudget(1e9), horizon_s=60.0, present=absent)
    assert [int(tree.prefix_values(n)[-1]) for n in kept] == [9]  # only what the store holds, with its parents


def test_a_block_worth_less_than_its_fetch_is_not_retained() -> None:
    tree = _tree()
    uses = np.full(tree.n_nodes, 0.01)
    pricey = PlanCosts(COST.prefill, 1.0, gpu_s_per_gib_hour=0.0, gpu_s_per_gib_fetched=2**30)  # a fetch: B GPU-s
    chosen, _ = retain_nodes(tree, uses, pricey, RetainBudget(1e9), horizon_s=60.0)
    assert len(chosen) == 0
    assert prefix_value(0.01, 4.0, B, 60.0, pricey, present=True) < 0 < prefix_value(0.01, 4.0, B, 60.0, COST,
                                                                                        present=True)
    assert prefix_value(1.0, 4.0, B, 60.0, COST, present=False) == pytest.approx(0.0)  # a prefill costs its seconds


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(BadInputError, match="node_bytes"):
        RetainBudget(node_bytes=-1)
