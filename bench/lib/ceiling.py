"""How good must a prediction be? Calibrations of the replay's targets (they read the future).

Two questions the what-if replay raises when a policy falls short of a target:

- **Prewarm.** Under LRU after a restart, a prewarm's gain depends only on how it ranks
  the blocks seen before ``T``. :func:`noisy_oracle_scores` degrades the oracle's
  ranking (first use after ``T``) by a random error shared by the blocks of one
  request, as a real predictor errs per conversation, not per block; replaying it for
  several error sizes gives the gap closed as a function of the ranking's quality
  (:func:`ranking_auc` of "used within the next few minutes"), to set beside the AUC a
  causal predictor reaches.
- **Retention.** :func:`first_reuse_hits` splits a cache's hits into a block's first
  reuse (typically a conversation's second turn re-reading its first) and later ones;
  Belady's advantage over an online policy sits in the first, which nothing known at
  the time predicts well (:func:`first_use_auc`).

None of this is a policy: every function here reads the trace after its decision time.
``bench/replay_bench.py --ceiling`` prints them on the tuning points.
"""
from __future__ import annotations

import numpy as np

from forecasting.simulate.prewarm import _first_use, last_uses
from forecasting.simulate.replay import (
    NEVER,
    BeladyCache,
    BlockIndex,
    PredictorConfig,
    RetentionCache,
    ReusePredictor,
    replay,
)

#: First-use delay given to blocks the served requests never use, in seconds.
UNUSED_DELAY_S = 1e4


def ranking_auc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve of ``score`` for boolean ``label`` (ties count one half).

    Raises:
        ValueError: ``label`` is all true or all false (the AUC is undefined).
    """
    score = np.asarray(score, dtype=np.float64)
    label = np.asarray(label, dtype=bool)
    n1 = int(label.sum())
    n0 = len(label) - n1
    if not n1 or not n0:
        raise ValueError(f"ranking_auc needs both classes; got {n1} positive and {n0} negative labels")
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - counts)[inverse] + (counts[inverse] - 1) / 2.0  # 0-based average ranks
    return float((ranks[label].sum() - n1 * (n1 - 1) / 2.0) / (n1 * n0))


def first_use_delay(index: BlockIndex, start: int, served: np.ndarray) -> np.ndarray:
    """Per dense block id, seconds from request ``start``'s time to its first use by ``served``.

    :data:`UNUSED_DELAY_S` when no served request uses it.
    """
    ts = index.trace.timestamps_s
    first = _first_use(index, served)
    t = ts[start] if start < len(ts) else ts[-1]
    return np.where(first < NEVER, ts[np.minimum(first, len(ts) - 1)] - t, UNUSED_DELAY_S)


def noisy_oracle_scores(index: BlockIndex, start: int, served: np.ndarray, noise_sd: float, *,
                        seed: int = 0) -> np.ndarray:
    """The oracle's ranking with an error of ``noise_sd`` per request (``-inf``: not seen before).

    A block seen before request ``start`` scores ``-log(1 + first-use delay) + e``,
    where ``e ~ N(0, noise_sd)`` is drawn once per request and shared by every block
    whose last use before ``start`` was in that request. ``noise_sd = 0`` is the
    oracle's own order (soonest used highest).

    Raises:
        ValueError: ``noise_sd`` is negative.
    """
    if noise_sd < 0:
        raise ValueError(f"noise_sd must be >= 0, got {noise_sd!r}")
    last = last_uses(index, start)
    seen = np.flatnonzero(last >= 0)
    error = np.random.default_rng(seed).normal(0.0, noise_sd, len(index.trace)) if noise_sd else None
    score = np.full(index.n_unique, -np.inf)
    score[seen] = -np.log1p(first_use_delay(index, start, served)[seen])
    if error is not None:
        score[seen] += error[index.request[last[seen]]]
    return score


def first_reuse_hits(index: BlockIndex, hits: np.ndarray) -> dict[str, int]:
    """Hit block occurrences (block 0 excluded) of a whole-trace replay, split by the block's use count.

    ``first_reuse``: the block had been used exactly once before (for a conversation,
    mostly its second turn reading the first); ``later_reuse``: more than once.
    ``hits`` is :func:`~forecasting.simulate.replay.replay`'s result over every request.
    """
    uses_before = use_counts(index)
    hit = (index.depth < np.asarray(hits)[index.request]) & (index.depth > 0)
    return {"first_reuse": int((hit & (uses_before == 1)).sum()),
            "later_reuse": int((hit & (uses_before >= 2)).sum())}


def steady_reuse_split(index: BlockIndex, capacity: int,
                       config: PredictorConfig = PredictorConfig()) -> dict[str, dict[str, int]]:
    """Belady's and retention's hits over the whole trace at ``capacity``, split by :func:`first_reuse_hits`."""
    rows = np.arange(len(index.trace), dtype=np.int64)
    return {name: first_reuse_hits(index, replay(index, cache, rows)) for name, cache in (
        ("belady", BeladyCache(capacity)), ("retention", RetentionCache(capacity, ReusePredictor(index, config))))}


def use_counts(index: BlockIndex) -> np.ndarray:
    """Per block occurrence, how many times its block was used before it."""
    n = len(index.ids)
    order = np.lexsort((np.arange(n), index.ids))
    pos = np.arange(n)
    starts = np.r_[True, index.ids[order[1:]] != index.ids[order[:-1]]] if n else np.zeros(0, dtype=bool)
    out = np.zeros(n, dtype=np.int64)
    out[order] = pos - np.maximum.accumulate(np.where(starts, pos, 0))
    return out


def first_use_auc(index: BlockIndex, within_s: float, predictor: ReusePredictor | None = None) -> float:
    """How well the predictor's classes tell which new blocks come back within ``within_s``.

    Over the occurrences that are a block's first use (block 0 and chain tails
    excluded), the AUC of ``predictor.log_p`` of their class for "used again within
    ``within_s``". By default the predictor has seen every outcome of the trace (an
    in-sample, generous estimate).
    """
    if predictor is None:
        predictor = ReusePredictor(index)
        predictor.update(float("inf"))
    ts = index.trace.timestamps_s
    nxt = index.next_request
    occ_t = ts[index.request]
    gap = np.where(nxt == NEVER, np.inf, ts[np.minimum(nxt, len(ts) - 1)] - occ_t)
    tail = np.zeros(len(index.ids), dtype=bool)
    lengths = index.trace.chain_lengths()
    tail[index.trace.offsets[1:][lengths > 0] - 1] = True
    new = (use_counts(index) == 0) & (index.depth > 0) & ~tail
    return ranking_auc(predictor.log_p[predictor.classes[new]], gap[new] <= within_s)
