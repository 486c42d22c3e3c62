"""Mining: request prompts -> block paths through a prefix tree -> reused prefixes.

Each request's prompt is cut into full blocks (``block_size`` tokens, the store's
block) and walked down a prefix tree, one tree per tenant: a node is a block *and
everything before it*, exactly what a store key names (:func:`store.identity.keys.chain_key`).
Counting is vectorised with numpy: block contents are compared as bytes (exact, no
hash that could merge two prefixes), and the tree is built one depth at a time.
SHA-256 store keys are computed only for nodes reused by at least ``k`` requests.

Two inputs:

- :func:`mine_text`: prompts as text (tokenised in batches with the model's fast
  tokenizer) or as token ids; prefixes get the store's keys for the caller's
  :class:`~store.identity.keys.KeyRoot`.
- :func:`mine_hash_ids`: prompts as chained block hash ids (Mooncake, vLLM): no
  tokeniser, no tokens; prefixes get a stable id hashed from their path of ids.

:func:`candidates` picks the prefixes worth prewarming (see there).
"""
from __future__ import annotations

import hashlib
import itertools
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from forecasting.ingest.traces import Trace
from forecasting.mining.block_paths import build_paths, chained_paths, content_ids
from store.errors import BadInputError
from store.identity.keys import BlockKey, KeyRoot, chain_key, root_key, tree_keys

#: ``tokenizer(texts, add_special_tokens=False)["input_ids"]``: a HF PreTrainedTokenizerFast fits.
Tokenizer = Callable[..., Mapping[str, Sequence[Sequence[int]]]]
UNITS = ("tokens", "hash_ids")
_HASH_DOMAIN = b"kvwarm/hash-id-path/v1\x00"


class MiningError(BadInputError):
    """Mining cannot run on these inputs (the message says what to change)."""


@dataclass(frozen=True, eq=False)
class PrefixTree:
    """Requests' block paths through per-tenant prefix trees, as numpy arrays.

    Node ids are assigned depth by depth, so a parent's id is always smaller than its
    children's. Request ``i``'s path is ``path_nodes[offsets[i]:offsets[i + 1]]``
    (root block first); a request with no full block has an empty path but still
    counts in the total load.

    Attributes:
        times_us: int64 arrival time of each request, microseconds since the epoch (UTC).
        tenant_codes: int32 index into ``tenants`` per request.
        tenants: tenant names.
        offsets, path_nodes: the paths (CSR).
        parent: int64 parent node (-1 at depth 1); ``depth``: int32, 1 = first block.
        node_tenant: int32 tenant code per node; ``count``: distinct requests per node.
        rep_request: a request whose path passes through each node.
        unit: ``tokens`` or ``hash_ids``: what ``seq_values`` holds.
        seq_values, seq_offsets: each request's whole prompt (tokens, partial block
            included; or its hash ids), CSR.
        block_size: tokens per block.
        roots: per tenant code, the KeyRoot of its keys (``tokens`` trees), else None.
    """

    times_us: np.ndarray
    tenant_codes: np.ndarray
    tenants: tuple[str, ...]
    offsets: np.ndarray
    path_nodes: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    node_tenant: np.ndarray
    count: np.ndarray
    rep_request: np.ndarray
    unit: str
    seq_values: np.ndarray
    seq_offsets: np.ndarray
    block_size: int
    roots: tuple[KeyRoot | None, ...] = field(default=(), repr=False)

    @property
    def n_requests(self) -> int:
        return len(self.times_us)

    @property
    def n_nodes(self) -> int:
        return len(self.parent)

    @property
    def n_blocks(self) -> int:
        """Block references mined (sum of path lengths)."""
        return len(self.path_nodes)

    def sequence(self, request: int) -> np.ndarray:
        """One request's whole prompt as tokens (or hash ids)."""
        return self.seq_values[self.seq_offsets[request]:self.seq_offsets[request + 1]]

    def prefix_values(self, node: int) -> np.ndarray:
        """The tokens (or hash ids) from the root down to and including ``node``."""
        width = self.block_size if self.unit == "tokens" else 1
        return self.sequence(int(self.rep_request[node]))[: int(self.depth[node]) * width]

    def node_keys(self, nodes: Sequence[int] | np.ndarray) -> list[str]:
        """Hex ids of ``nodes``: the store's block key (tokens) or a hash of the id path.

        A ``tokens`` node's id is :func:`store.identity.keys.chain_key` chained from the tenant's
        root, equal to the last of ``store.identity.keys.block_keys(root, prefix tokens)``.
        """
        memo: dict[int, str] = {}
        return [self._key(int(n), memo) for n in nodes]

    def all_node_keys(self) -> list[str]:
        """Every node's store key (a ``tokens`` tree), each computed once, parents first (:func:`store.identity.keys.tree_keys`).

        Raises:
            MiningError: a ``hash_ids`` tree (its nodes have no store keys).
        """
        if self.unit != "tokens":
            raise MiningError("only a tree of token ids has store keys for every node")
        starts = self.seq_offsets[self.rep_request] + (self.depth.astype(np.int64) - 1) * self.block_size
        blocks = self.seq_values[starts[:, None] + np.arange(self.block_size)]
        return tree_keys(self.parent, [self._root_of(c) for c in range(len(self.tenants))], self.node_tenant, blocks)

    def _key(self, node: int, memo: dict[int, str]) -> str:
        if self.unit == "hash_ids":
            # The whole path of ids in one digest: stable across runs, no ancestor chain needed.
            tenant = self.tenants[self.node_tenant[node]].encode()
            path = self.prefix_values(node).astype("<i8").tobytes()
            return hashlib.sha256(_HASH_DOMAIN + struct.pack("<I", len(tenant)) + tenant + path).hexdigest()
        chain = []
        while node >= 0 and node not in memo:
            chain.append(node)
            node = int(self.parent[node])
        for n in reversed(chain):
            p = int(self.parent[n])
            start = int(self.seq_offsets[self.rep_request[n]]) + (int(self.depth[n]) - 1) * self.block_size
            parent_key = memo[p] if p >= 0 else root_key(self._root(n))
            memo[n] = chain_key(BlockKey(parent_key), self.seq_values[start:start + self.block_size])
        return memo[chain[0]] if chain else memo[node]

    def _root(self, node: int) -> KeyRoot:
        return self._root_of(int(self.node_tenant[node]))

    def _root_of(self, code: int) -> KeyRoot:
        root = self.roots[code] if code < len(self.roots) else None
        if root is None:
            raise MiningError(f"no KeyRoot for tenant {self.tenants[code]!r}")
        return root


def mine_text(requests: pd.DataFrame, tokenizer: Tokenizer | None, roots: KeyRoot | Mapping[str, KeyRoot], *,
              model: str | None = None, batch_size: int = 1024) -> PrefixTree:
    """Tokenise, block-align and walk every request into per-tenant prefix trees.

    Rows with ``token_ids`` use them as they are; rows with only ``prompt`` text are
    tokenised in batches (``tokenizer(texts, add_special_tokens=False)["input_ids"]``);
    rows with only ``hash_ids`` count in the total load with no blocks.

    Args:
        requests: a frame with ``timestamp``, ``tenant`` and ``prompt``/``token_ids``
            columns, as :func:`forecasting.ingest.logs.read_logs` returns.
        tokenizer: the model's fast tokenizer (``None`` when every row has token ids).
        roots: the KeyRoot of every tenant (a mapping), or one root when the log holds
            a single tenant. Its ``block_size`` is the block size mined.
        model: mine only the rows of this model (required when the log holds several).
        batch_size: prompts per tokenizer call.

    Raises:
        MiningError: several models and no ``model``; a tenant without a root; tenants
            sharing one root (their keys would collide); text rows and no tokenizer.
    """
    requests = one_model(requests, model)
    tenants, codes = _tenants(requests)
    root_list = _roots(roots, tenants)
    block = root_list[0].block_size if root_list else 1
    if any(r.block_size != block for r in root_list):
        raise MiningError("every tenant's KeyRoot must have the same block_size")
    n = len(requests)
    seqs: list[Any] = list(requests["token_ids"]) if "token_ids" in requests else [None] * n
    texts: list[Any] = list(requests["prompt"]) if "prompt" in requests else [None] * n
    todo = [i for i, (s, t) in enumerate(zip(seqs, texts)) if s is None and isinstance(t, str)]
    if todo and tokenizer is None:
        raise MiningError(f"{len(todo)} rows have prompt text only: pass the model's tokenizer")
    for lo in range(0, len(todo), batch_size):
        idx = todo[lo:lo + batch_size]
        ids = tokenizer([texts[i] for i in idx], add_special_tokens=False)["input_ids"]
        for i, toks in zip(idx, ids):
            seqs[i] = toks
    lengths = np.fromiter((0 if s is None else len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = _flat_tokens([s for s in seqs if s is not None], int(lengths.sum()))
    return _tree_from_tokens(_times_us(requests), codes, tenants, flat, lengths, block, tuple(root_list))


def tokenize_requests(requests: pd.DataFrame, tokenizer: Tokenizer, *, batch_size: int = 1024) -> pd.DataFrame:
    """A copy of ``requests`` in which every row with prompt text and no ``token_ids`` gets them.

    The tokenisation :func:`mine_text` does (``tokenizer(texts, add_special_tokens=False)``,
    int64 arrays), split out so that log partitions can be tokenised apart (in parallel,
    on other machines) and their union mined once: ``mine_text(tokenize_requests(r, tok),
    None, roots)`` builds the same tree as ``mine_text(r, tok, roots)``. Rows that already
    have ``token_ids`` and rows with only ``hash_ids`` are left as they are.

    Raises:
        MiningError: ``batch_size`` is below 1.
    """
    if batch_size < 1:
        raise MiningError(f"batch_size must be at least 1, got {batch_size}")
    out = requests.copy()
    n = len(out)
    seqs: list[Any] = list(out["token_ids"]) if "token_ids" in out else [None] * n
    texts: list[Any] = list(out["prompt"]) if "prompt" in out else [None] * n
    todo = [i for i, (s, t) in enumerate(zip(seqs, texts)) if s is None and isinstance(t, str)]
    for lo in range(0, len(todo), batch_size):
        idx = todo[lo:lo + batch_size]
        ids = tokenizer([texts[i] for i in idx], add_special_tokens=False)["input_ids"]
        for i, toks in zip(idx, ids):
            seqs[i] = np.asarray(toks, dtype=np.int64)
    out["token_ids"] = pd.Series(seqs, index=out.index, dtype=object)
    return out


def mine_hash_ids(times_us: np.ndarray, hash_ids: np.ndarray, offsets: np.ndarray, *, block_size: int,
                  tenant_codes: np.ndarray | None = None, tenants: Sequence[str] = ("default",)) -> PrefixTree:
    """Walk requests given as block hash ids (one id per block, root first) into prefix trees.

    No tokenising and no SHA-256 per block: numpy end to end. Ids are compared along
    the whole path, so the result is right whether or not the ids are chained.

    Args:
        times_us: int64 arrival times (microseconds since the epoch) per request.
        hash_ids: int64 ids of every request's blocks, concatenated.
        offsets: int64, ``n + 1`` entries: request ``i`` owns ``hash_ids[offsets[i]:offsets[i + 1]]``.
        block_size: tokens each id stands for (512 for Mooncake).
        tenant_codes: int index into ``tenants`` per request (default: all 0).
        tenants: tenant names.
    """
    times = np.asarray(times_us, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    ids = np.asarray(hash_ids, dtype=np.int64)
    if len(offsets) != len(times) + 1 or offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
        raise MiningError("offsets must have one entry more than times_us, start at 0, rise, and end at len(hash_ids)")
    codes = np.zeros(len(times), np.int32) if tenant_codes is None else np.asarray(tenant_codes, dtype=np.int32)
    lengths = np.diff(offsets)
    paths = chained_paths(ids, lengths, codes) or build_paths(content_ids(ids), lengths, codes)
    nodes, parent, depth, node_root, rep = paths
    return PrefixTree(times, codes, tuple(tenants), offsets, nodes, parent, depth, node_root,
                      np.bincount(nodes, minlength=len(parent)), rep, "hash_ids", ids, offsets, int(block_size),
                      (None,) * len(tenants))


def mine_hash_log(requests: pd.DataFrame, *, block_size: int, model: str | None = None) -> PrefixTree:
    """:func:`mine_hash_ids` on a log frame's ``hash_ids`` column (rows without ids: no blocks)."""
    requests = one_model(requests, model)
    tenants, codes = _tenants(requests)
    seqs = [s if s is not None else () for s in requests["hash_ids"]]
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(offsets[-1]))
    return mine_hash_ids(_times_us(requests), ids, offsets, block_size=block_size, tenant_codes=codes,
                         tenants=tenants)


def mine_trace(trace: Trace) -> PrefixTree:
    """:func:`mine_hash_ids` on a :class:`forecasting.ingest.traces.Trace` (e.g. from ``read_mooncake``)."""
    times = np.round((trace.start_s + trace.timestamps_s) * 1e6).astype(np.int64)
    if isinstance(trace.tenants, str):
        names, codes = (trace.tenants,), None
    else:
        codes, uniq = pd.factorize(pd.Series(trace.tenants, dtype=object), sort=True)
        names = tuple(str(u) for u in uniq)
    return mine_hash_ids(times, trace.block_ids, trace.offsets, block_size=trace.block_tokens,
                         tenant_codes=codes, tenants=names)


def candidates(tree: PrefixTree, k: int = 3) -> np.ndarray:
    """Prefixes worth prewarming: nodes reused by at least ``k`` distinct requests where
    their requests part ways (branch or end), sorted by node id.

    A node whose requests all continue into one child is left out: that child's prefix
    is longer, serves exactly the same requests, and prefilling it computes the
    node's block too. So a shared system prompt under several templates is one
    candidate and each template another; a family's longest common block-aligned
    prefix is always one (its members part ways right after it).
    """
    if k < 1:
        raise MiningError(f"k must be at least 1, got {k}")
    has_parent = tree.parent >= 0
    widest_child = np.zeros(tree.n_nodes, dtype=np.int64)
    np.maximum.at(widest_child, tree.parent[has_parent], tree.count[has_parent])
    return np.flatnonzero((tree.count >= k) & (widest_child != tree.count))


def bucket_counts(tree: PrefixTree, nodes: np.ndarray, bucket_us: int, start_us: int,
                  n_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Requests per node per time bucket, and all requests per bucket.

    Returns ``(per_node, total)``: ``per_node[j, b]`` counts requests through
    ``nodes[j]`` arriving in ``[start + b * bucket, start + (b + 1) * bucket)``;
    requests outside the range are not counted.
    """
    slot = (tree.times_us - start_us) // bucket_us
    inside = (slot >= 0) & (slot < n_buckets)
    total = np.bincount(slot[inside], minlength=n_buckets).astype(np.float64)
    index = np.full(tree.n_nodes, -1, dtype=np.int64)
    index[nodes] = np.arange(len(nodes))
    row_request = np.repeat(np.arange(tree.n_requests), np.diff(tree.offsets))
    row_index = index[tree.path_nodes]
    keep = (row_index >= 0) & inside[row_request]
    flat = row_index[keep] * n_buckets + slot[row_request[keep]]
    per_node = np.bincount(flat, minlength=len(nodes) * n_buckets).astype(np.float64).reshape(len(nodes), n_buckets)
    return per_node, total


def _flat_tokens(seqs: list[Any], total: int) -> np.ndarray:
    """Every prompt's token ids end to end, as uint32 (arrays are joined in C, not element by element).

    Raises:
        MiningError: an id outside [0, 2**32).
    """
    if not total:
        return np.zeros(0, dtype=np.uint32)
    joined = np.concatenate([np.asarray(s) for s in seqs if len(s)])
    if joined.dtype.kind not in "iu" or int(joined.min()) < 0 or int(joined.max()) > 2**32 - 1:
        raise MiningError("token ids must be integers in [0, 2**32)")
    return joined.astype(np.uint32, copy=False)


def _tree_from_tokens(times: np.ndarray, codes: np.ndarray, tenants: tuple[str, ...], flat: np.ndarray,
                      lengths: np.ndarray, block: int, roots: tuple[KeyRoot, ...]) -> PrefixTree:
    seq_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n_full = lengths // block
    offsets = np.concatenate([[0], np.cumsum(n_full)]).astype(np.int64)
    depth_of_row = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], n_full)
    first = np.repeat(seq_offsets[:-1], n_full) + depth_of_row * block
    rows = flat[first[:, None] + np.arange(block)]
    # Exact block identity: compare the raw bytes of each block (no hash can merge two blocks).
    raw = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel()
    _, content = np.unique(raw, return_inverse=True)
    nodes, parent, depth, node_root, rep = build_paths(content.astype(np.int64).ravel(), n_full, codes)
    return PrefixTree(times, codes, tenants, offsets, nodes, parent, depth, node_root,
                      np.bincount(nodes, minlength=len(parent)), rep, "tokens", flat, seq_offsets, block, roots)


def one_model(requests: pd.DataFrame, model: str | None) -> pd.DataFrame:
    """The rows of ``model``, or all rows when the log holds one model (each model has its own keys).

    Raises:
        MiningError: ``model`` is None and the log holds several models.
    """
    if "model" not in requests:
        return requests
    if model is not None:
        return requests[requests["model"] == model].reset_index(drop=True)
    models = sorted(set(requests["model"]))
    if len(models) > 1:
        raise MiningError(f"the log holds {len(models)} models ({', '.join(models[:5])}...): pass model= one of them; "
                          "each model has its own tokenizer and keys")
    return requests


def _tenants(requests: pd.DataFrame) -> tuple[tuple[str, ...], np.ndarray]:
    codes, names = pd.factorize(requests["tenant"], sort=True)
    return tuple(str(n) for n in names), codes.astype(np.int32)


def _roots(roots: KeyRoot | Mapping[str, KeyRoot], tenants: tuple[str, ...]) -> list[KeyRoot]:
    if isinstance(roots, KeyRoot):
        if len(tenants) > 1:
            raise MiningError(f"one KeyRoot for {len(tenants)} tenants ({', '.join(tenants[:5])}): their keys would "
                              "collide; pass a mapping tenant -> KeyRoot (each with the tenant's salt)")
        return [roots] * len(tenants)
    missing = [t for t in tenants if t not in roots]
    if missing:
        raise MiningError(f"no KeyRoot for tenant(s) {', '.join(missing[:5])}: add them to roots")
    out = [roots[t] for t in tenants]
    seen: dict[str, str] = {}
    for t, r in zip(tenants, out):
        key = root_key(r)
        if key in seen:
            raise MiningError(f"tenants {seen[key]!r} and {t!r} share one KeyRoot: their keys would collide; "
                              "give each tenant a root with its own salt")
        seen[key] = t
    return out


def _times_us(requests: pd.DataFrame) -> np.ndarray:
    ts = pd.to_datetime(requests["timestamp"])
    if ts.dt.tz is not None:
        ts = ts.dt.tz_convert("UTC").dt.tz_localize(None)
    return ts.to_numpy(dtype="datetime64[us]").astype(np.int64)
