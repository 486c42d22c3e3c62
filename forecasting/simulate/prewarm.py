"""What a node is prewarmed with: a kvwarm plan's blocks, or the oracle's (the ceiling).

- :func:`plan_blocks` / :func:`plan_priorities`: the blocks a plan names, in the order a
  loader prefetches them (entries by priority, each chain from its root) and the
  retention priority each gets (the highest score of the entries through it);
- :func:`tree_blocks`: which trace block each node of a mined tree is (so the planner's
  ``present`` can ask the replay's store);
- :func:`oracle_prewarm`: the best prefetch from blocks stored before the event: those
  the window's requests use, earliest first use first, each only if its copy can land
  before that use at the channel's rate. It reads the future: a ceiling, never a policy.
"""
from __future__ import annotations

import numpy as np

from forecasting.ingest.traces import simulation_root
from forecasting.mining.prefix_tree import PrefixTree
from forecasting.simulate.replay import NEVER, BlockIndex
from store.errors import BadInputError
from store.identity.keys import block_keys
from store.plan import Plan, PlanEntry


def _dense_lookup(index: BlockIndex) -> dict[str, int] | None:
    names = index.trace.key_names
    return None if names is None else {names[int(orig)]: i for i, orig in enumerate(index.original)}


def _by_hash(index: BlockIndex, tenants: list[str], ids: np.ndarray, dense: dict[str, int] | None) -> np.ndarray:
    """Dense ids of hash ids (-1: not in the trace). A log trace keys its hash-id rows
    ``"tenant/id"``; otherwise (a Mooncake trace, or the planner fed the trace's own
    block ids) the ids are the trace's block ids."""
    ids = np.asarray(ids, dtype=np.int64)
    if dense is not None and tenants and f"{tenants[0]}/{int(ids[0])}" in dense:
        return np.array([dense.get(f"{t}/{int(h)}", -1) for t, h in zip(tenants, ids)], dtype=np.int64)
    at = np.searchsorted(index.original, ids)
    ok = (at < index.n_unique) & (index.original[np.minimum(at, max(index.n_unique - 1, 0))] == ids)
    return np.where(ok, at, -1).astype(np.int64)


def _hash_blocks(index: BlockIndex, entry: PlanEntry, dense: dict[str, int] | None) -> list[int | None]:
    ids = list(entry.hash_ids or ())
    found = _by_hash(index, [entry.tenant] * len(ids), np.asarray(ids), dense) if ids else np.zeros(0, np.int64)
    return [int(b) if b >= 0 else None for b in found.tolist()]


def entry_blocks(index: BlockIndex, entry: PlanEntry, dense: dict[str, int] | None, extra: dict[str, int], *,
                 model: str = "simulate") -> list[int]:
    """Dense block ids of one entry's prefix, root first; blocks the trace lacks get ids from
    ``index.n_unique`` up (``extra`` remembers them): they take room and never hit."""
    if entry.hash_ids is not None:
        found = _hash_blocks(index, entry, dense)
        keys = [f"{entry.tenant}/{h}" for h in entry.hash_ids]
    else:
        if entry.token_ids is None:
            raise BadInputError(f"plan entry of tenant {entry.tenant!r} has text but no token_ids: the simulation keys "
                                "token ids; write the plan from tokenised logs (the pipeline's plans carry token_ids)")
        if dense is None:
            raise BadInputError("a plan entry of token ids needs a trace with block keys (--format kvwarm or logs): "
                                "this trace has none to match the plan's prefixes against")
        keys = block_keys(simulation_root(entry.tenant, index.trace.block_tokens, model=model), entry.token_ids)
        found = [dense.get(k) for k in keys]
        if keys and found[-1] is None and entry.prefix_id in dense:  # a trace of serving keys
            chain, b = [], dense[entry.prefix_id]
            while b >= 0:
                chain.append(b)
                b = int(index.parent[b])
            return chain[::-1]
    return [b if b is not None else extra.setdefault(k, index.n_unique + len(extra)) for b, k in zip(found, keys)]


def plan_blocks(index: BlockIndex, plan: Plan, *, model: str = "simulate") -> np.ndarray:
    """The blocks of a plan's prefixes in prefetch order: entries by priority, each from its root, once each.

    ``token_ids`` entries are keyed as :func:`forecasting.ingest.traces.read_kvwarm` keys
    ``token_ids`` rows (:func:`~forecasting.ingest.traces.simulation_root` of the entry's
    tenant and ``model``; full blocks only); ``hash_ids`` entries name the trace's own
    block ids. Blocks the trace never uses get ids from ``index.n_unique`` up.

    Raises:
        BadInputError: a token entry on a trace without block keys (a Mooncake trace), or
            an entry with text only.
    """
    return plan_priorities(index, plan, model=model)[0]


def plan_priorities(index: BlockIndex, plan: Plan, *, model: str = "simulate") -> tuple[np.ndarray, dict[int, float]]:
    """:func:`plan_blocks`, and each block's retention priority: the highest score of the
    entries through it, as a loader gives it (positive: above every block the plan does not name)."""
    dense = _dense_lookup(index)
    extra: dict[str, int] = {}
    order: dict[int, None] = {}
    priority: dict[int, float] = {}
    for entry in plan.entries:
        score = max(float(entry.score), 1e-12)
        for b in entry_blocks(index, entry, dense, extra, model=model):
            order.setdefault(b, None)
            if score > priority.get(b, 0.0):
                priority[b] = score
    return np.fromiter(order, dtype=np.int64, count=len(order)), priority


def tree_blocks(index: BlockIndex, tree: PrefixTree) -> np.ndarray:
    """Per node of ``tree`` (mined from this trace's requests), its dense block id (-1: not in the trace).

    A tree of hash ids names a node by its last id (the ids are chained); a tree of
    tokens by its store key (the trace's ``key_names``, keyed with the same roots).
    """
    if tree.unit == "hash_ids":
        if not tree.n_nodes:
            return np.zeros(0, dtype=np.int64)
        starts = tree.seq_offsets[tree.rep_request] + np.asarray(tree.depth, dtype=np.int64) - 1
        tenants = [tree.tenants[int(c)] for c in tree.node_tenant]
        return _by_hash(index, tenants, tree.seq_values[starts], _dense_lookup(index))
    dense = _dense_lookup(index) or {}
    return np.array([dense.get(k, -1) for k in tree.all_node_keys()], dtype=np.int64)


def first_use(index: BlockIndex, served: np.ndarray) -> np.ndarray:
    """Per dense block id, the first of ``served`` requests that uses it (``NEVER``: none)."""
    first = np.full(index.n_unique, NEVER, dtype=np.int64)
    occ = occurrences(index, np.asarray(served, dtype=np.int64))
    np.minimum.at(first, index.ids[occ], index.request[occ])
    return first


def occurrences(index: BlockIndex, rows: np.ndarray) -> np.ndarray:
    """Indices into the block arrays of every block of requests ``rows`` (in order)."""
    offsets = index.trace.offsets
    lengths = offsets[rows + 1] - offsets[rows]
    starts = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.repeat(offsets[rows] - starts, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def oracle_prewarm(index: BlockIndex, start: int, served: np.ndarray, stored: np.ndarray, *, capacity: int,
                   fetch_s: float, skip: set[int] | frozenset[int] = frozenset()) -> np.ndarray:
    """The best prefetch at request ``start`` for the ``served`` requests: the ceiling of prewarming.

    Candidates are the blocks stored by then (``stored[b] <= start``) that a served request
    uses, not in ``skip`` (the node holds them already). In order of first use, a block is
    taken when its copy, one each ``fetch_s`` seconds after those taken before it, lands
    by that use: earliest deadline first, which lands the most blocks in time. At most
    ``capacity``. Returns the blocks in fetch order.
    """
    first = first_use(index, served)
    cand = np.flatnonzero((stored <= start) & (first < NEVER))
    if skip:
        cand = cand[~np.isin(cand, np.fromiter(skip, dtype=np.int64, count=len(skip)))]
    cand = cand[np.argsort(first[cand], kind="stable")]
    ts = index.trace.timestamps_s
    due = ts[first[cand]]
    clock = float(ts[start]) if start < len(ts) else float(ts[-1])
    taken: list[int] = []
    for b, t in zip(cand.tolist(), due.tolist()):
        if len(taken) >= capacity:
            break
        if clock + fetch_s <= t:
            clock += fetch_s
            taken.append(b)
    return np.asarray(taken, dtype=np.int64)
