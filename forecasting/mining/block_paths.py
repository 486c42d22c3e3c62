"""Block paths through a prefix tree: node ids for every block of every request, vectorised.

A node is a block *and everything before it*: the pair (parent node, block content),
under one root per tenant. :func:`build_paths` assigns nodes one depth at a time;
:func:`chained_paths` is the one-sort fast path for chained ids (Mooncake's
``hash_ids``, vLLM's block hashes), where an id already names its whole prefix.
:mod:`forecasting.mining.prefix_tree` builds its :class:`~forecasting.mining.prefix_tree.PrefixTree` from them.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def content_ids(values: np.ndarray) -> np.ndarray:
    """Dense ids (0..n-1) of ``values``: equal values, equal ids."""
    _, inverse = np.unique(values, return_inverse=True)
    return inverse.astype(np.int64).ravel()


def chained_paths(ids: np.ndarray, lengths: np.ndarray, req_root: np.ndarray):
    """The fast path for chained ids (each id always at one depth under one parent).

    Then an id *is* a prefix-tree node and one sort finds them all; returns None when
    some id breaks the rule (the caller then builds the tree depth by depth).
    """
    n_rows = len(ids)
    if n_rows == 0:
        return None
    starts = (np.cumsum(lengths) - lengths).astype(np.int64)
    request_of_row = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    depth_of_row = np.arange(n_rows, dtype=np.int64) - np.repeat(starts, lengths)
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    # Parent of a row as an id index; at depth 0 the tenant, encoded below zero.
    up = np.empty(n_rows, dtype=np.int64)
    top = depth_of_row == 0
    up[top] = -1 - req_root[request_of_row[top]].astype(np.int64)
    up[~top] = inverse[np.flatnonzero(~top) - 1]
    if not (np.array_equal(up, up[first][inverse]) and np.array_equal(depth_of_row, depth_of_row[first][inverse])):
        return None
    depth = depth_of_row[first]
    order = np.argsort(depth, kind="stable")
    renumber = np.empty(len(uniq), dtype=np.int64)
    renumber[order] = np.arange(len(uniq))
    parent_old = up[first][order]
    parent = np.where(parent_old >= 0, renumber[np.maximum(parent_old, 0)], -1)
    reps = request_of_row[first][order]
    return (renumber[inverse], parent, (depth[order] + 1).astype(np.int32),
            req_root[reps].astype(np.int32), reps)


def build_paths(content: np.ndarray, lengths: np.ndarray, req_root: np.ndarray):
    """Assign prefix-tree node ids to rows (request-major, depth within), one depth at a time.

    A node at depth d is the pair (node at depth d - 1, block content); at depth 1 the
    pair (tenant, content). Returns (node per row, parent, depth, tenant, representative
    request) with nodes numbered depth by depth.
    """
    n_rows = len(content)
    starts = (np.cumsum(lengths) - lengths).astype(np.int64)
    request_of_row = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    depth_of_row = np.arange(n_rows, dtype=np.int64) - np.repeat(starts, lengths)
    order = np.argsort(depth_of_row, kind="stable")
    max_depth = int(lengths.max()) if len(lengths) else 0
    bounds = np.searchsorted(depth_of_row[order], np.arange(max_depth + 1))
    width = int(content.max()) + 1 if n_rows else 1
    node_of_row = np.empty(n_rows, dtype=np.int64)
    parents, depths, roots, reps = [], [], [], []
    next_id = 0
    for d in range(max_depth):
        rows = order[bounds[d]:bounds[d + 1]]
        up = req_root[request_of_row[rows]].astype(np.int64) if d == 0 else node_of_row[rows - 1]
        uniq, first, inverse = np.unique(up * width + content[rows], return_index=True, return_inverse=True)
        node_of_row[rows] = next_id + inverse.ravel()
        parents.append(np.full(len(uniq), -1, np.int64) if d == 0 else up[first])
        depths.append(np.full(len(uniq), d + 1, np.int32))
        roots.append(req_root[request_of_row[rows[first]]].astype(np.int32))
        reps.append(request_of_row[rows[first]])
        next_id += len(uniq)

    def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    return node_of_row, cat(parents, np.int64), cat(depths, np.int32), cat(roots, np.int32), cat(reps, np.int64)
