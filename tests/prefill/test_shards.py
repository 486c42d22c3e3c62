"""The sharder: every block in exactly one shard, shared prefixes split below with waits, balance, priority."""
from __future__ import annotations

import random

import pytest

from prefill.shards import PrefixTokens, balance, make_shards, prefixes_of
from store.cost import PrefillCost
from tests.prefill.shard_plans import BLOCK, SYSTEM, independent_plan, shared_prompt_plan, under_system


def _prefixes(plan):
    return prefixes_of(plan.entries, lambda text, chat: [])


def _blocks(p: PrefixTokens) -> list[tuple]:
    n = len(p.token_ids) // BLOCK
    return [(p.group, p.token_ids[:(d + 1) * BLOCK]) for d in range(n)]


def _owned_blocks(shard, prefixes) -> set:
    """The blocks a shard computes: its shared prefixes, and its entries' blocks beyond the prefixes it waits for."""
    by = {p.entry: p for p in prefixes}

    def beyond_waits(ids: tuple, blocks: list) -> list:
        skip = max([w.blocks for w in shard.waits if len(ids) >= w.blocks * BLOCK
                    and ids[:w.blocks * BLOCK] == by[w.entry].token_ids[:w.blocks * BLOCK]], default=0)
        return blocks[skip:]

    out = set()
    for c in shard.computes:
        out.update(beyond_waits(by[c.entry].token_ids[:c.blocks * BLOCK], _blocks(by[c.entry])[:c.blocks]))
    for e in shard.entries:
        out.update(beyond_waits(by[e].token_ids, _blocks(by[e])))
    return out


def test_every_entry_and_block_belongs_to_one_shard_and_the_system_prompt_is_split_below():
    plan = shared_prompt_plan()
    prefixes = _prefixes(plan)
    shards = make_shards(prefixes, 2, block_size=BLOCK)
    assert sorted(e for s in shards for e in s.entries) == list(range(40))
    owned = [_owned_blocks(s, prefixes) for s in shards]
    every = {b for p in prefixes for b in _blocks(p)}
    assert owned[0] | owned[1] == every
    assert not owned[0] & owned[1], "a block computed by two shards"
    # the system prompt is computed by one shard, first; the other waits for it; both serve prefixes under it
    computes = [c for s in shards for c in s.computes]
    assert len(computes) == 1 and computes[0].blocks == len(SYSTEM) // BLOCK
    owner = computes[0].owner
    other = shards[1 - owner]
    assert [(w.entry, w.blocks, w.owner) for w in other.waits] == [(computes[0].entry, 2, owner)]
    under = set(under_system(plan))
    assert under & set(shards[0].entries) and under & set(shards[1].entries)


def test_entries_are_in_plan_order_in_every_shard():
    for s in make_shards(_prefixes(shared_prompt_plan()), 3, block_size=BLOCK):
        assert list(s.entries) == sorted(s.entries)


def test_shards_are_balanced_by_estimated_gpu_seconds_and_the_estimate_adds_up():
    plan = shared_prompt_plan(80, 50, seed=3)
    prefixes = _prefixes(plan)
    cost = PrefillCost().scaled(2000.0)
    shards = make_shards(prefixes, 4, block_size=BLOCK, cost=cost)
    every = {b for p in prefixes for b in _blocks(p)}
    expected = sum(cost.seconds(len(t), len(t) - BLOCK) for _, t in every)
    assert sum(s.est_gpu_s for s in shards) == pytest.approx(expected)
    assert sum(s.est_tokens for s in shards) == len(every) * BLOCK
    assert balance(shards)["max_over_mean"] <= 1.15


def test_the_quadratic_term_prices_deep_blocks_higher():
    deep = PrefixTokens(0, "t", tuple(range(32 * BLOCK)))
    shallow = [PrefixTokens(i, "t", tuple(range(10_000 * i, 10_000 * i + BLOCK))) for i in range(1, 65)]
    flat = make_shards([deep, *shallow], 2, block_size=BLOCK, cost=PrefillCost(1.0, 0.0))
    quad = make_shards([deep, *shallow], 2, block_size=BLOCK, cost=PrefillCost(1.0, 0.01))
    deep_of = lambda shards: next(s for s in shards if 0 in s.entries)  # noqa: E731
    # flat, the 32-block prefix is half of 64 one-block ones; with attention priced in it outweighs them all
    assert len(deep_of(flat).entries) > 1
    assert deep_of(quad).entries == (0,)


def test_a_prefix_tree_with_no_branch_is_not_split():
    chain = [PrefixTokens(i, "t", tuple(range((i + 1) * BLOCK))) for i in range(6)]
    shards = make_shards(chain, 3, block_size=BLOCK)
    assert [len(s.entries) for s in shards].count(6) == 1 and not any(s.waits or s.computes for s in shards)


def test_nested_shared_prefixes_wait_for_every_foreign_owner_above():
    rnd = random.Random(5)
    top = tuple(range(BLOCK))
    mids = [top + tuple(range(1000 * m, 1000 * m + BLOCK)) for m in range(2)]
    prefixes = [PrefixTokens(i, "t", mids[i % 2] + tuple(rnd.randrange(5000, 6000) for _ in range(2 * BLOCK)))
                for i in range(24)]
    shards = make_shards(prefixes, 4, block_size=BLOCK, cost=PrefillCost(1.0, 0.0))
    owned = [_owned_blocks(s, prefixes) for s in shards]
    assert sum(len(o) for o in owned) == len(set().union(*owned)), "a block computed by two shards"
    assert set().union(*owned) == {b for p in prefixes for b in _blocks(p)}


def test_groups_never_share_blocks_and_short_entries_own_none():
    same = tuple(range(2 * BLOCK))
    prefixes = [PrefixTokens(0, ("a", False), same), PrefixTokens(1, ("b", False), same),
                PrefixTokens(2, ("a", True), same), PrefixTokens(3, ("a", False), (1, 2, 3))]
    shards = make_shards(prefixes, 3, block_size=BLOCK)
    assert sorted(e for s in shards for e in s.entries) == [0, 1, 2, 3]
    assert sum(s.est_tokens for s in shards) == 3 * 2 * BLOCK
    assert sorted(len(s.entries) for s in shards) == [1, 1, 2]


def test_sharding_is_deterministic_and_one_shard_is_the_whole_plan():
    prefixes = _prefixes(shared_prompt_plan())
    assert make_shards(prefixes, 2, block_size=BLOCK) == make_shards(prefixes, 2, block_size=BLOCK)
    (one,) = make_shards(prefixes, 1, block_size=BLOCK)
    assert one.entries == tuple(range(40)) and not one.waits and not one.computes


def test_more_shards_than_work_leaves_some_empty():
    shards = make_shards(_prefixes(independent_plan(2, 1)), 4, block_size=BLOCK)
    assert sorted(len(s.entries) for s in shards) == [0, 0, 1, 1]


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_a_bad_shard_count_is_refused(bad):
    with pytest.raises(ValueError, match="positive integer"):
        make_shards(_prefixes(independent_plan(2, 1)), bad, block_size=BLOCK)
