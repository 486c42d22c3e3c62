"""Replay: LRU and Belady against hand-computed traces."""
from __future__ import annotations

import numpy as np
import pytest

from forecasting.ingest.traces import from_chains
from forecasting.simulate.replay import NEVER, BeladyCache, BlockIndex, LRUCache, next_use, replay
from tests.forecasting.simulate.hand_traces import REPLAY_CHAINS, dense_ids


def _index(chains: list[list[int]] = REPLAY_CHAINS, times: list[float] | None = None) -> BlockIndex:
    times = [float(i) for i in range(len(chains))] if times is None else times
    return BlockIndex.build(from_chains(times, chains))


def _originals(index: BlockIndex, blocks: list[int]) -> list[int]:
    return index.original[np.asarray(blocks, dtype=np.int64)].tolist()


def test_index_links_each_use_to_the_previous_and_next() -> None:
    index = _index()
    assert index.original[index.ids].tolist() == [b for c in REPLAY_CHAINS for b in c]
    # Occurrences of block 2: requests 0, 2, 4.
    occ2 = np.flatnonzero(index.original[index.ids] == 2)
    assert index.prev_request[occ2].tolist() == [-1, 0, 2]
    assert index.next_request[occ2].tolist() == [2, 4, NEVER]
    assert index.lead_seen.tolist() == [0, 1, 2, 2, 3]
    dense = dense_ids(index)
    assert index.parent[dense[4]] == dense[2] and index.parent[dense[3]] == dense[1]
    assert index.parent[dense[1]] == -1


def test_lru_matches_the_hand_computed_replay() -> None:
    # cap 3. r0 [1,2]: 0 hits, order (evict first) [2,1]. r1 [1,3]: 1 hit, [2,3,1].
    # r2 [1,2,4]: 2 hits, [3,1,4,2] -> touch 1 -> trim 3 -> [4,2,1]. r3 [1,3]: 1 hit, [2,3,1].
    # r4 [1,2,4]: 2 hits.
    index = _index()
    cache = LRUCache(3)
    hits = replay(index, cache, range(4))
    assert hits.tolist() == [0, 1, 2, 1]
    assert _originals(index, cache.blocks()) == [2, 3, 1]
    assert replay(index, cache, [4]).tolist() == [2]


def test_lru_evicts_the_deepest_block_of_a_request_first() -> None:
    index = _index([[5, 6, 7, 8]])
    cache = LRUCache(2)
    replay(index, cache, [0])
    assert _originals(index, cache.blocks()) == [6, 5]  # the tail went first; the prefix stays usable


def test_belady_matches_the_hand_computed_replay() -> None:
    # r2 leaves 1(next r3), 2(r4), 3(r3), 4(r4) for 3 slots: 2 and 4 tie on next use, the
    # deeper (4) goes. r3 then hits 1 and 3, r4 hits 1 and 2: 0,1,2,2,2.
    index = _index()
    cache = BeladyCache(3)
    assert replay(index, cache, range(5)).tolist() == [0, 1, 2, 2, 2]
    assert sum(replay(index, LRUCache(3), range(5))) == 6


def test_belady_evicts_blocks_never_used_again_first() -> None:
    index = _index([[1, 2, 3], [9, 8], [1, 2, 3]])
    assert replay(index, BeladyCache(3), range(3)).tolist() == [0, 0, 3]
    # LRU: [3,2,1] + 8, 9 -> evicts 3 then 2, keeping only the root of the chain.
    assert replay(index, LRUCache(3), range(3)).tolist() == [0, 0, 1]


def test_belady_sees_only_the_future_of_the_requests_it_serves() -> None:
    index = _index([[1, 2], [3, 4], [1, 2], [3, 4]])
    served = np.array([0, 1, 3])
    nxt = next_use(index, served)
    occ1 = np.flatnonzero(index.original[index.ids] == 1)
    assert nxt[occ1].tolist() == [NEVER, NEVER]  # request 2 goes to another replica
    occ3 = np.flatnonzero(index.original[index.ids] == 3)
    assert nxt[occ3].tolist() == [3, NEVER]
    assert replay(index, BeladyCache(2, nxt), served).tolist() == [0, 0, 2]


def test_belady_is_not_prewarmable() -> None:
    with pytest.raises(ValueError, match="cannot be prewarmed"):
        BeladyCache(3).load([1])
