"""Demand: mined prefixes as long tables that forecasting consumes.

The contract between mining and forecasting (statsforecast's long format):

- ``series``: ``unique_id`` (the prefix key: hex block key of the prefix's last
  block), ``ds`` (bucket start, tz-naive UTC), ``y`` (float64 requests whose prompt
  begins with the whole prefix), one row per prefix and bucket of the observed range,
  zero buckets included;
- ``total``: ``ds``, ``y``: every request per bucket (the total load);
- ``prefixes``: one row per ``unique_id``: ``tenant``, ``n_tokens``, ``n_blocks``,
  ``distinct_requests``, ``family`` (str or None), ``token_ids`` (list of ints, None
  when only hash ids were logged), ``text`` (str or None), and ``parent`` (the nearest
  enclosing prefix's ``unique_id`` or None: a system prompt above its templates);
- ``families``: ``unique_id`` (family id), ``ds``, ``y``: requests per family per bucket,
  for forecasting a family's total and splitting it down to its prefixes.

A request counts in every prefix it begins with, so a parent's series is at least the
sum over its children's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from forecasting.mining.families import Families
from forecasting.mining.prefix_tree import PrefixTree, bucket_counts, candidates

SERIES_COLUMNS = ("unique_id", "ds", "y")
TOTAL_COLUMNS = ("ds", "y")
PREFIX_COLUMNS = ("unique_id", "tenant", "n_tokens", "n_blocks", "distinct_requests", "family", "token_ids", "text",
                  "parent")
DEFAULT_BUCKET = pd.Timedelta(hours=1)


def _empty_families() -> pd.DataFrame:
    return pd.DataFrame({"unique_id": pd.Series(dtype=object), "ds": pd.Series(dtype="datetime64[us]"),
                         "y": pd.Series(dtype=np.float64)})


@dataclass(frozen=True, eq=False)
class Demand:
    """Per-prefix demand, total load and what each prefix is (see the module docstring).

    Raises:
        ValueError: a frame lacks a required column, or ``bucket`` is not positive.
    """

    series: pd.DataFrame
    total: pd.DataFrame
    bucket: pd.Timedelta
    prefixes: pd.DataFrame
    families: pd.DataFrame = field(default_factory=_empty_families)

    def __post_init__(self) -> None:
        for name, frame, cols in (("series", self.series, SERIES_COLUMNS), ("total", self.total, TOTAL_COLUMNS),
                                  ("prefixes", self.prefixes, PREFIX_COLUMNS[:-1])):
            missing = [c for c in cols if c not in frame.columns]
            if missing:
                raise ValueError(f"Demand.{name} lacks column(s) {', '.join(missing)}; it needs {', '.join(cols)}")
        if not isinstance(self.bucket, pd.Timedelta) or self.bucket <= pd.Timedelta(0):
            raise ValueError(f"Demand.bucket must be a positive pandas Timedelta, got {self.bucket!r}")

    def prefix(self, unique_id: str) -> pd.Series:
        """One prefix's row of ``prefixes``."""
        return self.prefixes.loc[self.prefixes["unique_id"] == unique_id].iloc[0]

    def of(self, unique_id: str) -> pd.Series:
        """One prefix's demand as a Series indexed by ``ds``."""
        rows = self.series[self.series["unique_id"] == unique_id]
        return pd.Series(rows["y"].to_numpy(), index=pd.DatetimeIndex(rows["ds"]), name=unique_id)


def build_demand(tree: PrefixTree, *, k: int = 3, bucket: pd.Timedelta | str = DEFAULT_BUCKET,
                 families: Families | None = None, start: Any = None, end: Any = None,
                 decode: Callable[[Sequence[int]], str] | None = None) -> Demand:
    """Count each candidate prefix's requests per bucket (:func:`forecasting.mining.prefix_tree.candidates`).

    Args:
        tree: a mined prefix tree.
        k: a prefix needs at least ``k`` distinct requests.
        bucket: bucket length (default 1 h); buckets are aligned to the Unix epoch
            (hours start on the hour, days at midnight UTC).
        families: families of the same tree, to label prefixes and count family totals.
        start, end: the range of buckets (default: the first to the last request's).
            Requests outside it are not counted.
        decode: token ids -> text (the tokenizer's ``decode``) to fill ``text``.

    Raises:
        ValueError: ``bucket`` is not positive or ``start`` is after ``end``.
    """
    step = pd.Timedelta(bucket)
    if step <= pd.Timedelta(0):
        raise ValueError(f"bucket must be positive, got {bucket!r}")
    step_us = int(step.value // 1000)
    if step_us < 1:
        raise ValueError(f"bucket must be at least 1 microsecond, got {bucket!r}")
    times = tree.times_us
    lo = _us(start) if start is not None else (int(times.min()) if len(times) else 0)
    hi = _us(end) if end is not None else (int(times.max()) + 1 if len(times) else lo)
    if hi < lo:
        raise ValueError(f"start ({start}) is after end ({end})")
    first = (lo // step_us) * step_us
    n_buckets = max(0, -(-(hi - first) // step_us))
    nodes = candidates(tree, k)
    per_node, total = bucket_counts(tree, nodes, step_us, first, n_buckets)
    ds = pd.to_datetime(first + step_us * np.arange(n_buckets, dtype=np.int64), unit="us").astype("datetime64[us]")
    keys = tree.node_keys(nodes)
    series = pd.DataFrame({"unique_id": np.repeat(np.asarray(keys, dtype=object), n_buckets),
                           "ds": np.tile(ds.to_numpy(), len(nodes)), "y": per_node.ravel()})
    total_frame = pd.DataFrame({"ds": ds, "y": total})
    prefixes = _prefix_table(tree, nodes, keys, families, decode)
    fam_series = _family_series(tree, families, step_us, first, n_buckets, ds) if families else _empty_families()
    return Demand(series, total_frame, step, prefixes, fam_series)


def _prefix_table(tree: PrefixTree, nodes: np.ndarray, keys: list[str], families: Families | None,
                  decode: Callable[[Sequence[int]], str] | None) -> pd.DataFrame:
    node_family = families.node_families(tree) if families is not None else None
    family_ids = list(families.table["family"]) if families is not None else []
    key_of = dict(zip(nodes.tolist(), keys))
    rows = []
    for node, key in zip(nodes.tolist(), keys):
        blocks = int(tree.depth[node])
        values = tree.prefix_values(node)
        tokens = [int(t) for t in values] if tree.unit == "tokens" else None
        fam = int(node_family[node]) if node_family is not None else -1
        up = int(tree.parent[node])
        while up >= 0 and up not in key_of:
            up = int(tree.parent[up])
        rows.append({
            "unique_id": key,
            "tenant": tree.tenants[int(tree.node_tenant[node])],
            "n_tokens": blocks * tree.block_size,
            "n_blocks": blocks,
            "distinct_requests": int(tree.count[node]),
            "family": family_ids[fam] if fam >= 0 else None,
            "token_ids": tokens,
            "text": decode(tokens) if decode is not None and tokens is not None else None,
            "parent": key_of[up] if up >= 0 else None,
            "hash_ids": None if tokens is not None else [int(v) for v in values],
        })
    # Build each column with its final dtype: letting pandas infer them would give the text
    # columns pandas 3's string dtype, whose missing value is NaN, not the None promised above.
    frame = pd.DataFrame({col: pd.Series([r[col] for r in rows], dtype=object)
                          for col in (*PREFIX_COLUMNS, "hash_ids")})
    return frame.astype({"n_tokens": np.int64, "n_blocks": np.int64, "distinct_requests": np.int64})


def _family_series(tree: PrefixTree, families: Families, step_us: int, first: int, n_buckets: int,
                   ds: pd.DatetimeIndex) -> pd.DataFrame:
    slot = (tree.times_us - first) // step_us
    keep = (families.labels >= 0) & (slot >= 0) & (slot < n_buckets)
    n_fam = len(families.table)
    counts = np.bincount(families.labels[keep] * n_buckets + slot[keep], minlength=n_fam * n_buckets)
    return pd.DataFrame({"unique_id": np.repeat(families.table["family"].to_numpy(dtype=object), n_buckets),
                         "ds": np.tile(ds.to_numpy(), n_fam), "y": counts.astype(np.float64)})


def _us(value: Any) -> int:
    ts = pd.Timestamp(value)
    if ts.tzinfo is not None:
        ts = ts.tz_convert("UTC").tz_localize(None)
    return int(ts.value // 1000)
