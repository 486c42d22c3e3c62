"""Hierarchical forecasts: forecast a family's (or tenant's) total, split it down to prefixes.

Per-prefix series are sparse and noisy; their sum over a family or a tenant is smooth
enough for the seasonal models to beat naive forecasts clearly. So the demand is
summed up the hierarchy (:func:`aggregate`), forecast at the parent level, and
brought back down to the prefixes so that the children's forecasts add up to the
parent's (coherent):

- :func:`top_down` splits the parent forecast by each child's share of the parent's
  recent history (Gross & Sohl's "proportions of historical averages"): right when
  the mix of prefixes in a family is stable, and works for series with a handful of
  requests;
- :func:`forecast_proportions` rescales the children's own forecasts to sum to the
  parent's (Athanasopoulos et al., 2009): keeps each child's own shape when it has one.

Tables are long: ``(unique_id, ds, y)`` for history, ``(unique_id, ds, y_hat)`` for
forecasts; ``mapping`` relates each child ``unique_id`` to its ``parent``.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd


def _mapping_frame(mapping: Mapping[str, str] | pd.DataFrame) -> pd.DataFrame:
    if isinstance(mapping, pd.DataFrame):
        missing = {"unique_id", "parent"} - set(mapping.columns)
        if missing:
            raise ValueError(f"mapping: a DataFrame needs columns 'unique_id' and 'parent' (missing {sorted(missing)})")
        m = mapping[["unique_id", "parent"]].copy()
    else:
        m = pd.DataFrame({"unique_id": list(mapping.keys()), "parent": list(mapping.values())})
    if m["unique_id"].duplicated().any():
        dup = m.loc[m["unique_id"].duplicated(), "unique_id"].iloc[0]
        raise ValueError(f"mapping: child {dup!r} has more than one parent")
    if m["parent"].isna().any():
        raise ValueError("mapping: some children have no parent; give them their own (e.g. the tenant)")
    m["unique_id"] = m["unique_id"].astype(str)
    m["parent"] = m["parent"].astype(str)
    return m


def _join(df: pd.DataFrame, m: pd.DataFrame, what: str) -> pd.DataFrame:
    out = df.assign(unique_id=df["unique_id"].astype(str)).merge(m, on="unique_id", how="left")
    if out["parent"].isna().any():
        orphan = out.loc[out["parent"].isna(), "unique_id"].iloc[0]
        raise ValueError(f"{what}: series {orphan!r} is not in the mapping")
    return out


def aggregate(history: pd.DataFrame, mapping: Mapping[str, str] | pd.DataFrame) -> pd.DataFrame:
    """Sum children's ``(unique_id, ds, y)`` into their parents' series (``unique_id`` = parent).

    Raises:
        ValueError: a series has no parent in ``mapping``, or a child has two.
    """
    m = _mapping_frame(mapping)
    joined = _join(history, m, "history")
    out = joined.groupby(["parent", "ds"], as_index=False, sort=True)["y"].sum()
    return out.rename(columns={"parent": "unique_id"})


def historical_shares(history: pd.DataFrame, mapping: Mapping[str, str] | pd.DataFrame, *,
                      window: int | None = None) -> pd.DataFrame:
    """Each child's share of its parent over the last ``window`` buckets (all when ``None``).

    Returns ``unique_id, parent, share``. A parent with no traffic in the window gives
    its children equal shares. Shares of one parent sum to 1.
    """
    m = _mapping_frame(mapping)
    h = history
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be a positive number of buckets, got {window!r}")
        ds = np.sort(h["ds"].unique())
        h = h[h["ds"] >= ds[max(0, ds.size - window)]]
    sums = _join(h, m, "history").groupby("unique_id", as_index=False)["y"].sum()
    out = m.merge(sums, on="unique_id", how="left").fillna({"y": 0.0})
    total = out.groupby("parent")["y"].transform("sum")
    count = out.groupby("parent")["y"].transform("size")
    out["share"] = np.where(total > 0, out["y"] / total.where(total > 0, 1.0), 1.0 / count)
    return out[["unique_id", "parent", "share"]]


def top_down(parent_forecast: pd.DataFrame, shares: pd.DataFrame) -> pd.DataFrame:
    """Split each parent's forecast by the children's shares.

    Args:
        parent_forecast: ``unique_id`` (parent), ``ds``, ``y_hat`` and optionally
            ``lower``/``upper`` (split the same way).
        shares: from :func:`historical_shares`.

    Returns:
        ``unique_id, parent, ds, y_hat[, lower, upper], p_any`` for every child;
        ``p_any`` takes the child's count in a bucket as Poisson.

    Raises:
        ValueError: a parent in ``shares`` has no forecast.
    """
    if "y_hat" not in parent_forecast.columns:
        raise ValueError("parent_forecast needs a 'y_hat' column")
    pf = parent_forecast.rename(columns={"unique_id": "parent"})
    pf = pf.assign(parent=pf["parent"].astype(str))
    missing = set(shares["parent"]) - set(pf["parent"])
    if missing:
        raise ValueError(f"no forecast for parent(s) {sorted(missing)[:5]}; forecast every parent first")
    cols = [c for c in ("y_hat", "lower", "upper") if c in pf.columns]
    out = shares.merge(pf[["parent", "ds", *cols]], on="parent", how="inner")
    for c in cols:
        out[c] = out[c] * out["share"]
    out["p_any"] = 1.0 - np.exp(-out["y_hat"].to_numpy(dtype=np.float64))
    return out[["unique_id", "parent", "ds", *cols, "p_any"]].sort_values(["unique_id", "ds"], ignore_index=True)


def forecast_proportions(parent_forecast: pd.DataFrame, child_forecast: pd.DataFrame,
                         mapping: Mapping[str, str] | pd.DataFrame) -> pd.DataFrame:
    """Rescale the children's own forecasts, bucket by bucket, so they sum to the parent's.

    Where all children forecast zero in a bucket, the parent's forecast is split
    equally. Returns ``unique_id, parent, ds, y_hat, p_any``.
    """
    m = _mapping_frame(mapping)
    cf = _join(child_forecast[["unique_id", "ds", "y_hat"]], m, "child_forecast")
    pf = parent_forecast[["unique_id", "ds", "y_hat"]].rename(columns={"unique_id": "parent", "y_hat": "parent_y_hat"})
    pf = pf.assign(parent=pf["parent"].astype(str))
    out = cf.merge(pf, on=["parent", "ds"], how="left")
    if out["parent_y_hat"].isna().any():
        p = out.loc[out["parent_y_hat"].isna(), "parent"].iloc[0]
        raise ValueError(f"no parent forecast for {p!r} at some child forecast times")
    total = out.groupby(["parent", "ds"])["y_hat"].transform("sum")
    count = out.groupby(["parent", "ds"])["y_hat"].transform("size")
    out["y_hat"] = np.where(total > 0, out["y_hat"] / total.where(total > 0, 1.0), 1.0 / count) * out["parent_y_hat"]
    out["p_any"] = 1.0 - np.exp(-out["y_hat"].to_numpy(dtype=np.float64))
    return out[["unique_id", "parent", "ds", "y_hat", "p_any"]].sort_values(["unique_id", "ds"], ignore_index=True)
