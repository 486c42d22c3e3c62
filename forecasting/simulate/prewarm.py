"""Prewarm choices at an event time ``T``: which blocks to load into an empty cache.

- :func:`naive_prewarm`: the blocks with the most requests in a lookback before ``T``;
- :func:`kvwarm_prewarm`: the blocks with the highest predicted reuse at ``T``
  (:class:`~forecasting.simulate.replay.ReusePredictor`), closed under prefixes;
- :func:`oracle_prewarm`: the best possible prewarm from blocks seen before ``T`` (the ceiling);
- :func:`plan_blocks` / :func:`planned_prewarm`: the blocks of a kvwarm plan file, the prewarm
  the real pipeline would have made (its forecasts saw whatever logs it was given);
- :func:`first_use_order`: any block set in the oracle's order (a diagnostic that reads the future).

Each returns block ids least valuable first, from the trace before ``T`` only (the
oracle excepted, by definition). :mod:`forecasting.simulate.simulation` replays them.
"""
from __future__ import annotations

import math

import numpy as np

from forecasting.ingest.traces import simulation_root
from forecasting.simulate.replay import NEVER, BlockIndex, PredictorConfig, ReusePredictor
from store.errors import BadInputError
from store.identity.keys import block_keys
from store.plan import Plan


def naive_prewarm(index: BlockIndex, start: int, capacity: int, lookback_s: float) -> np.ndarray:
    """Blocks with the most requests in ``lookback_s`` before request ``start`` (most valuable last).

    Ties go to the block used most recently.
    """
    tr = index.trace
    t = tr.timestamps_s[start] if start < len(tr) else math.inf
    first = int(np.searchsorted(tr.timestamps_s, t - lookback_s, side="left"))
    a, z = tr.offsets[first], tr.offsets[start]
    counts = np.bincount(index.ids[a:z], minlength=index.n_unique)
    last = np.full(index.n_unique, -1, dtype=np.int64)
    np.maximum.at(last, index.ids[a:z], np.arange(a, z))
    cand = np.flatnonzero(counts)
    order = np.lexsort((last[cand], counts[cand]))
    return cand[order][-capacity:] if capacity else cand[:0]


def _close_under_prefix(index: BlockIndex, score: np.ndarray, depth_of: np.ndarray) -> np.ndarray:
    """Raise each parent's score to at least its children's (a child hits only with its parent)."""
    score = score.copy()
    known = np.flatnonzero(np.isfinite(score))
    known = known[np.argsort(-depth_of[known], kind="stable")]
    levels = depth_of[known]
    cuts = np.flatnonzero(np.diff(levels)) + 1
    for kids in np.split(known, cuts):  # deepest level first, so raises propagate to the root
        if len(kids) and depth_of[kids[0]] > 0:
            np.maximum.at(score, index.parent[kids], score[kids])
    return score


def kvwarm_prewarm(index: BlockIndex, start: int, capacity: int,
                   config: PredictorConfig = PredictorConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of highest predicted reuse at request ``start``'s time, from the trace before it.

    Each block seen before is scored at its last use, ``log p(reuse | class) + t_last / tau``,
    with the class table estimated from outcomes closed before the prewarm time; scores
    are closed under prefixes and the top ``capacity`` kept.

    Returns:
        (blocks, scores), least valuable first.
    """
    tr = index.trace
    t = tr.timestamps_s[start] if start < len(tr) else math.inf
    predictor = ReusePredictor(index, config)
    predictor.update(t)
    last = last_uses(index, start)
    seen = np.flatnonzero(last >= 0)
    score = np.full(index.n_unique, -np.inf)
    occ = last[seen]
    score[seen] = (predictor.log_p[predictor.classes[occ]]
                   + tr.timestamps_s[index.request[occ]] / config.tau_s)
    return ranked_prewarm(index, start, score, capacity)


def last_uses(index: BlockIndex, start: int) -> np.ndarray:
    """Per dense block id, its last occurrence before request ``start`` (-1: not seen before)."""
    z = int(index.trace.offsets[start])
    last = np.full(index.n_unique, -1, dtype=np.int64)
    np.maximum.at(last, index.ids[:z], np.arange(z))
    return last


def ranked_prewarm(index: BlockIndex, start: int, score: np.ndarray,
                   capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``capacity`` blocks of highest ``score`` seen before request ``start``, closed under prefixes.

    ``score`` is per dense block id (``-inf``: not a candidate). Each parent's score is
    raised to its children's (a child hits only with its parent); ties go to the
    shallower block.

    Returns:
        (blocks, closed scores), least valuable first.
    """
    z = int(index.trace.offsets[start])
    known = np.zeros(index.n_unique, dtype=bool)
    known[index.ids[:z]] = True
    depth_of = np.zeros(index.n_unique, dtype=np.int64)
    depth_of[index.ids[:z]] = index.depth[:z]
    score = _close_under_prefix(index, np.where(known, score, -np.inf), depth_of)
    seen = np.flatnonzero(known & np.isfinite(score))
    order = np.lexsort((-depth_of[seen], score[seen]))
    chosen = seen[order][-capacity:] if capacity else seen[:0]
    return chosen, score[chosen]


def oracle_prewarm(index: BlockIndex, start: int, served: np.ndarray, capacity: int) -> np.ndarray:
    """The best prewarm from blocks seen before request ``start``: those the ``served`` requests use.

    Ordered by first use (soonest used last, i.e. kept longest); the ceiling for prewarming.
    """
    z = int(index.trace.offsets[start])
    seen = np.zeros(index.n_unique, dtype=bool)
    seen[index.ids[:z]] = True
    first = _first_use(index, served)
    cand = np.flatnonzero(seen & (first < NEVER))
    return first_use_order(index, cand, served, first=first)[-capacity:] if capacity else cand[:0]


def first_use_order(index: BlockIndex, blocks: np.ndarray, served: np.ndarray, *,
                    first: np.ndarray | None = None) -> np.ndarray:
    """``blocks`` reordered as the oracle would load them: by first use among ``served`` requests.

    Blocks no served request uses come first (evicted first), then the latest first use,
    and the soonest used last (kept longest). Reads the future: a diagnostic (how much
    of a prewarm's shortfall is its order rather than its set), never a policy.
    """
    first = _first_use(index, served) if first is None else first
    blocks = np.asarray(blocks, dtype=np.int64)
    return blocks[np.argsort(-first[blocks], kind="stable")]


def _first_use(index: BlockIndex, served: np.ndarray) -> np.ndarray:
    """Per dense block id, the first of ``served`` requests that uses it (``NEVER``: none)."""
    first = np.full(index.n_unique, NEVER, dtype=np.int64)
    occ = _occurrences(index, np.asarray(served, dtype=np.int64))
    np.minimum.at(first, index.ids[occ], index.request[occ])
    return first


def _occurrences(index: BlockIndex, rows: np.ndarray) -> np.ndarray:
    """Indices into the block arrays of every block of requests ``rows`` (in order)."""
    offsets = index.trace.offsets
    lengths = offsets[rows + 1] - offsets[rows]
    starts = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.repeat(offsets[rows] - starts, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def plan_blocks(index: BlockIndex, plan: Plan, *, model: str = "simulate") -> np.ndarray:
    """Block ids of a kvwarm plan's prefixes, most valuable first: the order the prefill job computes them.

    Each entry's ``token_ids`` are keyed the way :func:`forecasting.ingest.traces.read_kvwarm`
    keys ``token_ids`` rows (:func:`~forecasting.ingest.traces.simulation_root` of the entry's
    tenant, ``model`` and the trace's block size; full blocks only, as the prefill job
    stores), so a plan mined from a log's token ids meets that log's blocks. When the
    trace holds serving keys (``block_keys`` rows), an entry whose ``prefix_id`` the
    trace has stands for that block and its ancestors instead. A block shared by several
    entries is listed once, at its first (most valuable) entry, parents before children.

    Blocks the trace never uses get ids from ``index.n_unique`` up: they take cache
    space and never hit, as a prewarmed snapshot that no request asks for does.

    Raises:
        BadInputError: the trace has no block keys (a Mooncake trace), or an entry has
            text but no token ids (named by its position).
    """
    names = index.trace.key_names
    if names is None:
        raise BadInputError("a plan prewarm needs a trace with block keys (--format kvwarm or logs): "
                         "this trace has no block keys to match the plan's prefixes against")
    dense = {names[int(orig)]: i for i, orig in enumerate(index.original)}
    order: dict[int, None] = {}
    extra: dict[str, int] = {}
    for pos, entry in enumerate(plan.entries):
        if entry.token_ids is None:
            raise BadInputError(f"plan entry {pos} (tenant {entry.tenant!r}) has text but no token_ids: the "
                             "simulation keys token ids; write the plan from tokenised logs (the pipeline's "
                             "plans carry token_ids)")
        keys = block_keys(simulation_root(entry.tenant, index.trace.block_tokens, model=model), entry.token_ids)
        if keys and keys[-1] not in dense and entry.prefix_id in dense:
            chain, b = [], dense[entry.prefix_id]
            while b >= 0:
                chain.append(b)
                b = int(index.parent[b])
            ids = chain[::-1]
        else:
            ids = [dense[k] if k in dense else extra.setdefault(k, index.n_unique + len(extra)) for k in keys]
        for b in ids:
            order.setdefault(b, None)
    return np.fromiter(order, dtype=np.int64, count=len(order))


def planned_prewarm(blocks: np.ndarray, capacity: int) -> np.ndarray:
    """The ``capacity`` most valuable of a plan's ``blocks`` (from :func:`plan_blocks`), least valuable first.

    Cut in the plan's order, so every kept block keeps its parent.
    """
    return np.asarray(blocks, dtype=np.int64)[:max(int(capacity), 0)][::-1].copy()
