"""Hand-made traces shared by the replay, prewarm, simulation and ceiling tests.

- ``REPLAY_CHAINS``: five requests, one token per block, block 1 the shared root; the
  LRU and Belady replays of it are computed by hand in test_replay.py.
- ``PREWARM_TIMES``, ``PREWARM_CHAINS``: seven requests one second apart, block 1 the
  shared root; the naive, oracle and ranked prewarm orders are computed by hand on it.
- :func:`perturbed`: a trace that is the same before a time and different after it, so
  that a policy which reads the future gives itself away.
- :func:`dense_ids`: an index's dense id of each original block id.
"""
from __future__ import annotations

import numpy as np

from forecasting.ingest.traces import Trace, from_chains
from forecasting.simulate.replay import BlockIndex

REPLAY_CHAINS = [[1, 2], [1, 3], [1, 2, 4], [1, 3], [1, 2, 4]]

PREWARM_TIMES = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
PREWARM_CHAINS = [[1, 9], [1, 2], [1, 3], [1, 2, 4], [1, 5], [1, 3, 6], [1, 2, 4, 7]]


def perturbed(trace: Trace, t: float) -> Trace:
    """Same requests before ``t``; after it, other chains (new ids, reordered) and times."""
    start = int(np.searchsorted(trace.timestamps_s, t))
    chains = [trace.chain(i).tolist() for i in range(len(trace))]
    later = [[c[0]] + [b + 10**9 for b in c[1:]] for c in reversed(chains[start:])]
    later[::3] = [chains[i] for i in range(start - len(later[::3]), start)]  # repeat recent history
    times = trace.timestamps_s.tolist()[:start] + sorted(t + 0.5 * k for k in range(len(later)))
    inputs = trace.input_tokens.tolist()[:start] + [512 * len(c) for c in later]
    return from_chains(times, chains[:start] + later, block_tokens=512, input_tokens=inputs)


def dense_ids(index: BlockIndex) -> dict[int, int]:
    """Original block id -> the index's dense id, for every block the index holds."""
    return {int(index.original[d]): d for d in range(index.n_unique)}
