"""Forecast a family's total and split it down to its prefixes, coherently."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from bench.lib.hierarchy import aggregate, forecast_proportions, historical_shares, top_down
from forecasting.models.catalog import candidates
from forecasting.models.selection import forecast_frame
from tests.forecasting.synth import daily_means, long_table, poisson

MAPPING = {"p1": "fam", "p2": "fam", "p3": "solo"}


def _history() -> pd.DataFrame:
    rng = np.random.default_rng(9)
    fam = poisson(daily_means(8, base=40, amp=30), seed=9)
    p1 = rng.binomial(fam.astype(int), 0.75).astype(float)  # p1 takes 3/4 of the family's requests
    return long_table({"p1": p1, "p2": fam - p1, "p3": poisson(np.full(8 * 24, 2.0), seed=10)})


def test_aggregate_sums_children_into_parents() -> None:
    hist = _history()
    agg = aggregate(hist, MAPPING)
    assert sorted(agg["unique_id"].unique()) == ["fam", "solo"]
    fam = agg[agg["unique_id"] == "fam"]["y"].to_numpy()
    kids = hist[hist["unique_id"].isin(["p1", "p2"])].groupby("ds")["y"].sum().to_numpy()
    np.testing.assert_array_equal(fam, kids)


def test_shares_recover_the_split_and_top_down_is_coherent() -> None:
    hist = _history()
    shares = historical_shares(hist, MAPPING, window=7 * 24)
    s = shares.set_index("unique_id")["share"]
    assert s["p1"] == pytest.approx(0.75, abs=0.03) and s["p3"] == 1.0
    assert shares.groupby("parent")["share"].sum().tolist() == pytest.approx([1.0, 1.0])
    parent_fc = forecast_frame(aggregate(hist, MAPPING), candidates, 24)
    kids = top_down(parent_fc, shares)
    summed = kids[kids["parent"] == "fam"].groupby("ds")["y_hat"].sum().to_numpy()
    np.testing.assert_allclose(summed, parent_fc[parent_fc["unique_id"] == "fam"]["y_hat"].to_numpy())
    assert {"lower", "upper", "p_any"} <= set(kids.columns)
    assert (kids["p_any"].between(0, 1)).all()


def test_forecast_proportions_keep_child_shapes_and_sum_to_the_parent() -> None:
    ds = pd.date_range("2025-01-01", periods=2, freq="h")
    child = pd.DataFrame({"unique_id": ["p1", "p1", "p2", "p2"], "ds": list(ds) * 2, "y_hat": [1.0, 0.0, 3.0, 0.0]})
    parent = pd.DataFrame({"unique_id": ["fam", "fam"], "ds": ds, "y_hat": [8.0, 6.0]})
    out = forecast_proportions(parent, child, {"p1": "fam", "p2": "fam"}).set_index(["unique_id", "ds"])["y_hat"]
    assert out[("p1", ds[0])] == 2.0 and out[("p2", ds[0])] == 6.0
    assert out[("p1", ds[1])] == 3.0 and out[("p2", ds[1])] == 3.0  # all zero: split equally


def test_orphans_and_double_parents_are_refused() -> None:
    hist = _history()
    with pytest.raises(ValueError, match="not in the mapping"):
        aggregate(hist, {"p1": "fam"})
    with pytest.raises(ValueError, match="more than one parent"):
        aggregate(hist, pd.DataFrame({"unique_id": ["p1", "p1"], "parent": ["a", "b"]}))
    shares = historical_shares(hist, MAPPING)
    with pytest.raises(ValueError, match="no forecast for parent"):
        top_down(pd.DataFrame({"unique_id": ["fam"], "ds": [hist["ds"].max()], "y_hat": [1.0]}), shares)
