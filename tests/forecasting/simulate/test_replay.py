"""Replay: LRU and Belady against hand-computed traces; retention learns only from the past."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forecasting.ingest.traces import from_chains, read_mooncake
from forecasting.simulate.replay import (
    NEVER,
    BeladyCache,
    BlockIndex,
    LRUCache,
    PredictorConfig,
    RetentionCache,
    ReusePredictor,
    next_use,
    occurrence_classes,
    replay,
)
from tests.forecasting.simulate.hand_traces import REPLAY_CHAINS, perturbed

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"


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
    dense = {int(index.original[d]): d for d in range(index.n_unique)}
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


def test_retention_keeps_the_class_that_comes_back() -> None:
    # Long history: short two-block chains (a, a') come back 30 s later, three-block
    # chains never do. With room for little, retention keeps what returns; LRU does not.
    chains, times, nxt = [], [], 1000
    for k in range(120):
        t = 10.0 * k
        c = [0, nxt, nxt + 1]
        chains.append(c)
        times.append(t)
        nxt += 2
        chains.append([0, nxt, nxt + 1, nxt + 2])
        times.append(t + 1)
        nxt += 3
    # Every short chain is asked again 30 s later.
    returns = [(times[2 * k] + 30.0, chains[2 * k]) for k in range(120)]
    rows = sorted([(t, c) for t, c in zip(times, chains)] + returns, key=lambda r: r[0])
    index = _index([c for _, c in rows], [t for t, _ in rows])
    config = PredictorConfig(horizon_s=60, tau_s=60, refresh_s=10)
    all_rows = range(len(rows))
    lru = replay(index, LRUCache(12), all_rows).sum()
    kept = replay(index, RetentionCache(12, ReusePredictor(index, config)), all_rows).sum()
    assert kept > lru * 1.5


def test_retention_decisions_before_t_ignore_the_trace_after_t() -> None:
    trace = read_mooncake(MOONCAKE)
    t = 300.0
    start = int(np.searchsorted(trace.timestamps_s, t))
    config = PredictorConfig(horizon_s=60, tau_s=120, refresh_s=15)
    results = []
    for tr in (trace, perturbed(trace, t)):
        index = BlockIndex.build(tr)
        cache = RetentionCache(1024, ReusePredictor(index, config))
        hits = replay(index, cache, range(start))
        predictor = ReusePredictor(index, config)
        predictor.update(t)
        classes = occurrence_classes(index)[: tr.offsets[start]]
        results.append((hits, sorted(_originals(index, cache.blocks())), predictor.log_p, classes))
    (h1, b1, p1, c1), (h2, b2, p2, c2) = results
    assert np.array_equal(h1, h2) and b1 == b2 and np.array_equal(c1, c2)
    assert np.array_equal(p1, p2)
    assert len(np.unique(p1)) > 3  # the predictor did learn from the past (not just its prior)
    # The perturbation is real: an estimate made after t sees a different trace.
    late = [ReusePredictor(BlockIndex.build(tr), config) for tr in (trace, perturbed(trace, t))]
    for p in late:
        p.update(470.0)
    assert not np.array_equal(late[0].log_p, late[1].log_p)


def test_predictor_refuses_to_go_back_in_time() -> None:
    predictor = ReusePredictor(_index(), PredictorConfig())
    predictor.update(10.0)
    with pytest.raises(ValueError, match="back in time"):
        predictor.update(5.0)
    with pytest.raises(ValueError, match="horizon_s"):
        PredictorConfig(horizon_s=0)
