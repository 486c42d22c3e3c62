"""The calibrations of :mod:`bench.lib.ceiling`: degraded oracle rankings, AUC, reuse splits.

Everything there reads the future (analysis for docs/simulate.md, never a policy).
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.lib.ceiling import (
    first_reuse_hits,
    first_use_auc,
    noisy_oracle_scores,
    ranking_auc,
    steady_reuse_split,
    use_counts,
)
from forecasting.ingest.traces import from_chains
from forecasting.simulate.replay import BlockIndex, LRUCache, replay
from tests.forecasting.simulate.hand_traces import PREWARM_CHAINS, PREWARM_TIMES, dense_ids


@pytest.fixture(scope="module")
def hand() -> BlockIndex:
    return BlockIndex.build(from_chains(PREWARM_TIMES, PREWARM_CHAINS))


def test_ranking_auc_counts_ordered_pairs_and_half_ties() -> None:
    assert ranking_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1], bool)) == pytest.approx(0.75)
    assert ranking_auc(np.ones(4), np.array([0, 1, 0, 1], bool)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="both classes"):
        ranking_auc(np.arange(3.0), np.ones(3, bool))


def test_noisy_oracle_errs_per_request_around_the_first_use_order(hand: BlockIndex) -> None:
    d = dense_ids(hand)
    served = np.array([5, 6])
    exact = noisy_oracle_scores(hand, 5, served, 0.0)
    # First uses after t=5: 1 and 3 at once, 2 and 4 one second later; 9 and 5 never; 6, 7 unseen.
    assert exact[d[1]] == exact[d[3]] == 0.0 and exact[d[2]] == exact[d[4]] == pytest.approx(-np.log(2))
    assert exact[d[9]] == exact[d[5]] < exact[d[2]] and np.isneginf(exact[[d[6], d[7]]]).all()
    noisy = noisy_oracle_scores(hand, 5, served, 2.0, seed=3)
    assert np.isneginf(noisy[[d[6], d[7]]]).all()
    shift = {b: noisy[d[b]] - exact[d[b]] for b in (1, 2, 4, 5, 9)}
    # Last uses before request 5: 2 and 4 in request 3, 1 and 5 in request 4: one error each.
    assert shift[2] == pytest.approx(shift[4]) and shift[1] == pytest.approx(shift[5])
    assert shift[2] != pytest.approx(shift[9])
    with pytest.raises(ValueError, match="noise_sd"):
        noisy_oracle_scores(hand, 5, served, -1.0)


def test_reuse_split_on_a_cache_that_never_evicts(hand: BlockIndex) -> None:
    assert use_counts(hand)[hand.original[hand.ids] == 2].tolist() == [0, 1, 2]
    hits = replay(hand, LRUCache(100), range(len(hand.trace)))
    # Hits beyond the root: 2 at request 3 (its first reuse), 3 at 5 (first), 2 and 4 at 6 (later, first).
    assert first_reuse_hits(hand, hits) == {"first_reuse": 3, "later_reuse": 1}
    assert steady_reuse_split(hand, 100) == {"belady": {"first_reuse": 3, "later_reuse": 1},
                                             "retention": {"first_reuse": 3, "later_reuse": 1}}


def test_first_use_auc_separates_a_class_that_comes_back() -> None:
    # Three-block chains are asked again 30 s later, four-block chains never.
    rows, nxt = [], 1000
    for k in range(60):
        rows += [(10.0 * k, [0, nxt, nxt + 1]), (10.0 * k + 30.0, [0, nxt, nxt + 1]),
                 (10.0 * k + 1, [0, nxt + 2, nxt + 3, nxt + 4])]
        nxt += 5
    rows.sort(key=lambda r: r[0])
    index = BlockIndex.build(from_chains([t for t, _ in rows], [c for _, c in rows]))
    assert first_use_auc(index, 180.0) == pytest.approx(1.0)
