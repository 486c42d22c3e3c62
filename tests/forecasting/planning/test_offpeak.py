"""Off-peak windows on known load curves, and choosing the load predictor by regret."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from forecasting.planning.offpeak import (
    choose_source,
    load_predictors,
    lowest_window,
    offpeak_windows,
    pick_window,
    profile_path,
    regret,
)
from tests.forecasting.synth import START, daily_means, poisson


def _series(values: np.ndarray, start: pd.Timestamp = START) -> pd.Series:
    return pd.Series(values, index=pd.date_range(start, periods=len(values), freq="h"))


def test_lowest_window_finds_the_trough_of_a_known_curve() -> None:
    load = _series(daily_means(1, trough_hour=4))
    w = lowest_window(load, 3)
    assert w.start == START + pd.Timedelta(hours=3) and w.end == START + pd.Timedelta(hours=6)
    assert w.length == pd.Timedelta(hours=3)
    assert lowest_window(load, pd.Timedelta(hours=3)) == w
    with pytest.raises(ValueError, match="does not fit"):
        lowest_window(load, 25)


def test_windows_under_a_fraction_of_the_peak_with_a_minimum_length() -> None:
    values = np.array([10, 10, 2, 2, 2, 10, 3, 10, 1, 1, 1, 1], dtype=float)
    load = _series(values)
    ws = offpeak_windows(load, fraction=0.5, min_length=pd.Timedelta(hours=2))
    assert [(w.start.hour, w.end.hour) for w in ws] == [(2, 5), (8, 12)]  # the 1-hour dip at 6 is too short
    assert ws[0].mean_load == 2.0 and ws[1].max_load == 1.0
    # against a stated capacity of 100, everything under 50 qualifies: one long window
    ws = offpeak_windows(load, fraction=0.5, capacity=100.0, min_length=pd.Timedelta(hours=2))
    assert len(ws) == 1 and ws[0].length == pd.Timedelta(hours=12)


def test_a_missing_bucket_breaks_a_window() -> None:
    load = _series(np.ones(6)).drop(START + pd.Timedelta(hours=3))
    ws = offpeak_windows(load, fraction=1.0, capacity=10.0, min_length=pd.Timedelta(hours=1),
                         bucket=pd.Timedelta(hours=1))
    assert [(w.start.hour, w.end.hour) for w in ws] == [(0, 3), (4, 6)]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fraction"):
        offpeak_windows(_series(np.ones(3)), fraction=0)
    with pytest.raises(ValueError, match="capacity"):
        offpeak_windows(_series(np.ones(3)), capacity=-1)
    with pytest.raises(ValueError, match="'ds' and 'y'"):
        offpeak_windows(pd.DataFrame({"x": [1]}))


def test_profile_and_regret() -> None:
    hist = np.tile(daily_means(1, trough_hour=10), 3)
    np.testing.assert_allclose(profile_path(hist, 24, days=3), daily_means(1, trough_hour=10))
    actual = daily_means(1, trough_hour=10)
    assert regret(actual, actual, 3) == 0.0
    assert regret(daily_means(1, trough_hour=22), actual, 3) > 1.0


def test_the_source_with_least_regret_picks_the_window() -> None:
    # the trough sits at 10:00 every day; "yesterday-at-4" is a predictor that is always wrong
    hist = _series(np.tile(daily_means(1, trough_hour=10), 8))
    sources = {"wrong": lambda x, h: daily_means(1, trough_hour=4)[:h],
               "profile": lambda x, h: profile_path(x, h, days=5)}
    choice = choose_source(hist.to_numpy(), sources, length=3, days=5)
    assert choice.name == "profile" and choice.regrets["profile"] == 0.0 and choice.regrets["wrong"] > 0.5
    w, _ = pick_window(hist, sources, length=3)
    assert w.start == hist.index[-1] + pd.Timedelta(hours=10) and w.length == pd.Timedelta(hours=3)


def test_a_failing_source_scores_infinity() -> None:
    def broken(x: np.ndarray, h: int) -> np.ndarray:
        raise ValueError("no model")

    choice = choose_source(np.ones(24 * 4), {"broken": broken, "flat": lambda x, h: np.ones(h)}, length=3)
    assert choice.name == "flat" and choice.regrets["broken"] == float("inf")


def test_the_shipped_predictors_find_a_noisy_daily_trough_within_the_horizon() -> None:
    hist = _series(poisson(daily_means(10, base=200.0, amp=150.0, trough_hour=10), seed=1))
    w, choice = pick_window(hist, load_predictors(24), length=3)
    assert set(choice.regrets) == {"forecast", "profile", "hw-log"}
    assert all(np.isfinite(r) for r in choice.regrets.values())
    assert abs(w.start.hour + 1 - 10) <= 1  # the 3 quietest hours centre on 10:00
    # a horizon shorter than a day: the window lies inside it
    w6, _ = pick_window(hist, load_predictors(24), length=3, horizon=6)
    assert hist.index[-1] < w6.start and w6.end <= hist.index[-1] + pd.Timedelta(hours=7)
    with pytest.raises(ValueError, match="no past period"):
        pick_window(hist.iloc[:48], load_predictors(24), length=3)
