"""Prompt families: near-duplicate prompts grouped with MinHash LSH, and their shared prefix.

A family is a set of a tenant's prompts that are near-duplicates of one another
(the same template with different user text, a document asked about several ways).
Each request's prompt becomes a set of shingles (token n-grams, or its block hash ids),
datasketch's ``MinHash.bulk`` sketches them and a ``MinHashLSH`` at the configured
Jaccard threshold (``kv_cache.similarity_threshold``, default 0.85) links neighbours;
a family is a connected group. Its longest common block-aligned prefix (the deepest
prefix-tree node all members pass through) is the part a cache can serve: it is a
candidate of :func:`forecasting.mining.prefix_tree.candidates` whenever the family has at least
``k`` requests, even though each prompt differs after it. Similarity only ever chooses
*what to count*; serving reuses KV for exact prefixes only (docs/architecture.md, invariant 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from datasketch import MinHash, MinHashLSH

from forecasting.mining.prefix_tree import PrefixTree

#: Bounds and step of the adaptive threshold (the SageMaker write-up's rule).
THRESHOLD_FLOOR, THRESHOLD_CEILING, THRESHOLD_STEP = 0.7, 0.95, 0.10
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, eq=False)
class Families:
    """Families found in one prefix tree.

    Attributes:
        labels: int64 per request of the tree: index into ``table`` (-1: in no family).
        table: one row per family: ``family`` (str id), ``tenant``, ``size`` (requests),
            ``lcp_node`` (prefix-tree node of the longest common block-aligned prefix, -1
            when the members share no full block), ``lcp_blocks``.
        threshold: the Jaccard threshold used; ``num_perm``: MinHash permutations.
    """

    labels: np.ndarray
    table: pd.DataFrame
    threshold: float
    num_perm: int

    def node_families(self, tree: PrefixTree) -> np.ndarray:
        """Per tree node, the family whose common prefix it is or extends (deepest wins), else -1.

        A shared system prompt above several families' prefixes belongs to none of them.
        """
        fam = np.full(tree.n_nodes, -1, dtype=np.int64)
        lcp = self.table["lcp_node"].to_numpy(dtype=np.int64)
        has = lcp >= 0
        fam[lcp[has]] = np.flatnonzero(has)
        # Node ids grow with depth, so one pass per depth carries labels down the tree.
        for d in range(2, int(tree.depth.max(initial=0)) + 1):
            nodes = np.flatnonzero((tree.depth == d) & (fam < 0))
            fam[nodes] = fam[tree.parent[nodes]]
        return fam


def find_families(tree: PrefixTree, *, threshold: float = 0.85, num_perm: int = 128, shingle: int = 4,
                  min_size: int = 2, seed: int = 1) -> Families:
    """Group each tenant's near-duplicate prompts and find each group's common prefix.

    Args:
        tree: a mined prefix tree (its whole prompts are shingled, partial block included).
        threshold: Jaccard similarity for LSH neighbours (0 < threshold < 1).
        num_perm: MinHash permutations (at least 128).
        shingle: tokens per shingle (hash-id trees use each id as a shingle).
        min_size: smallest family kept (requests, identical prompts included).
        seed: MinHash seed (fixed: families are reproducible).

    Raises:
        ValueError: an argument is out of range.
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    if num_perm < 128:
        raise ValueError(f"num_perm must be at least 128 for stable families, got {num_perm}")
    if shingle < 1 or min_size < 2:
        raise ValueError(f"shingle must be >= 1 and min_size >= 2, got {shingle} and {min_size}")
    n = tree.n_requests
    group = np.arange(n, dtype=np.int64)
    width = shingle if tree.unit == "tokens" else 1
    flat, offsets = batch_shingles(tree.seq_values, tree.seq_offsets, width)
    for code in range(len(tree.tenants)):
        members = np.flatnonzero(tree.tenant_codes == code)
        sets: dict[bytes, list[int]] = {}
        for r in members.tolist():
            if offsets[r + 1] > offsets[r]:
                sets.setdefault(flat[offsets[r]:offsets[r + 1]].tobytes(), []).append(r)
        if not sets:
            continue
        keys = list(sets)
        sketches = MinHash.bulk((np.frombuffer(k, dtype=np.uint32).tolist() for k in keys), num_perm=num_perm,
                                seed=seed, hashfunc=int)
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        with lsh.insertion_session() as session:
            for i, m in enumerate(sketches):
                session.insert(i, m, check_duplication=False)
        # Linking each band bucket's members in a chain gives the components that querying
        # every sketch would give (a query returns its band buckets' members), in linear time.
        parent = list(range(len(keys)))
        for table in lsh.hashtables:
            for bucket in table.keys():
                members = list(table.get(bucket))
                for j in members[1:]:
                    _union(parent, members[0], j)
        for i, k in enumerate(keys):
            root = sets[keys[_find(parent, i)]][0]
            group[sets[k]] = root
    return _assemble(tree, group, threshold, num_perm, min_size)


def shingles(values: np.ndarray, n: int) -> np.ndarray:
    """Sorted distinct 32-bit hashes of the ``n``-grams of ``values`` (the whole sequence if shorter)."""
    v = np.asarray(values, dtype=np.int64)
    flat, offsets = batch_shingles(v, np.array([0, len(v)], dtype=np.int64), n)
    return flat


def batch_shingles(values: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`shingles` of every sequence ``values[offsets[i]:offsets[i + 1]]`` at once (CSR out)."""
    v = np.asarray(values).astype(np.uint64)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    owner = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    width = np.minimum(lengths, n)  # a sequence shorter than n is one shingle
    # Window starting at position p covers width[owner] values; it is valid when it fits its sequence.
    last = offsets[1:] - width
    valid = np.arange(len(v), dtype=np.int64) <= np.repeat(last, lengths)
    h = np.zeros(len(v), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            take = np.minimum(np.arange(len(v)) + j, max(len(v) - 1, 0))
            inside = j < np.repeat(width, lengths)
            h = np.where(inside, (h ^ v[take]) * _MIX, h)
            h ^= h >> np.uint64(29)
    h32 = (h ^ (h >> np.uint64(32))).astype(np.uint32)[valid]
    who = owner[valid]
    pairs = np.unique((who.astype(np.uint64) << np.uint64(32)) | h32.astype(np.uint64))
    out_owner = (pairs >> np.uint64(32)).astype(np.int64)
    out = np.concatenate([[0], np.cumsum(np.bincount(out_owner, minlength=len(lengths)))]).astype(np.int64)
    return (pairs & np.uint64(0xFFFFFFFF)).astype(np.uint32), out


def adapt_threshold(threshold: float, hit_rate: float, *, floor: float = THRESHOLD_FLOOR,
                    ceiling: float = THRESHOLD_CEILING, step: float = THRESHOLD_STEP) -> float:
    """The next run's LSH threshold from the measured prewarm hit rate.

    A hit rate under 50 % means families were too strict to find shared prefixes, so
    the threshold drops by ``step`` (10 % of its value, not below ``floor``, 0.7);
    otherwise it rises by 10 % (not above ``ceiling``, 0.95) to keep families tight.

    Raises:
        ValueError: ``hit_rate`` outside [0, 1] or bounds out of order.
    """
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be a fraction in [0, 1], got {hit_rate}")
    if not 0.0 < floor <= ceiling < 1.0:
        raise ValueError(f"need 0 < floor <= ceiling < 1, got floor={floor}, ceiling={ceiling}")
    factor = 1.0 - step if hit_rate < 0.5 else 1.0 + step
    return float(min(ceiling, max(floor, threshold * factor)))


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def _union(parent: list[int], i: int, j: int) -> None:
    a, b = _find(parent, i), _find(parent, j)
    if a != b:
        parent[max(a, b)] = min(a, b)


def _assemble(tree: PrefixTree, group: np.ndarray, threshold: float, num_perm: int, min_size: int) -> Families:
    _, inverse, sizes = np.unique(group, return_inverse=True, return_counts=True)
    by_group = np.split(np.argsort(inverse.ravel(), kind="stable"), np.cumsum(sizes)[:-1])
    rows = [(by_group[g], _common_node(tree, by_group[g])) for g in np.flatnonzero(sizes >= min_size)]
    # Groups LSH split but whose members share the same common prefix are one family.
    by_node: dict[int, list[np.ndarray]] = {}
    for members, node in rows:
        by_node.setdefault(node if node >= 0 else -2 - int(members[0]), []).append(members)
    merged = sorted(((np.concatenate(ms), node) for node, ms in by_node.items()), key=lambda x: (-len(x[0]), x[1]))
    labels = np.full(tree.n_requests, -1, dtype=np.int64)
    nodes = [max(node, -1) for _, node in merged]
    keys = tree.node_keys([n for n in nodes if n >= 0])
    key_of = dict(zip([n for n in nodes if n >= 0], keys))
    table = []
    for f, ((members, _), node) in enumerate(zip(merged, nodes)):
        labels[members] = f
        tenant = tree.tenants[int(tree.tenant_codes[members[0]])]
        fid = f"f-{key_of[node][:16]}" if node >= 0 else f"f-{tenant}-r{int(members.min())}"
        table.append((fid, tenant, len(members), node, int(tree.depth[node]) if node >= 0 else 0))
    frame = pd.DataFrame(table, columns=["family", "tenant", "size", "lcp_node", "lcp_blocks"])
    frame = frame.astype({"size": np.int64, "lcp_node": np.int64, "lcp_blocks": np.int64})
    return Families(labels, frame, threshold, num_perm)


def _common_node(tree: PrefixTree, members: np.ndarray) -> int:
    """The deepest node every member's path passes through (-1: they share no full block)."""
    lengths = tree.offsets[members + 1] - tree.offsets[members]
    depth = int(lengths.min())
    if depth == 0:
        return -1
    paths = tree.path_nodes[tree.offsets[members][:, None] + np.arange(depth)]
    same = np.all(paths == paths[0], axis=0)
    shared = depth if same.all() else int(np.argmin(same))
    return int(paths[0, shared - 1]) if shared else -1
