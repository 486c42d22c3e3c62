"""Hand-made traces shared by the replay and prewarm tests.

- ``REPLAY_CHAINS``: five requests, one token per block, block 1 the shared root; the
  LRU and Belady replays of it are computed by hand in test_replay.py.
- ``PREWARM_TIMES``, ``PREWARM_CHAINS``: seven requests one second apart, block 1 the
  shared root; the oracle's prefetch is computed by hand on it.
- :func:`dense_ids`: an index's dense id of each original block id.
"""
from __future__ import annotations

from forecasting.simulate.replay import BlockIndex

REPLAY_CHAINS = [[1, 2], [1, 3], [1, 2, 4], [1, 3], [1, 2, 4]]

PREWARM_TIMES = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
PREWARM_CHAINS = [[1, 9], [1, 2], [1, 3], [1, 2, 4], [1, 5], [1, 3, 6], [1, 2, 4, 7]]


def dense_ids(index: BlockIndex) -> dict[int, int]:
    """Original block id -> the index's dense id, for every block the index holds."""
    return {int(index.original[d]): d for d in range(index.n_unique)}
