"""Forecasting models recover known seasonality and intermittency; caps, intervals, p(any)."""
from __future__ import annotations

import numpy as np
import pytest

from forecasting.models.base import FitError, check_series
from forecasting.models.catalog import candidates, robust_ensemble
from forecasting.models.ensemble import Ensemble
from forecasting.models.intermittent import Tsb, WindowMean
from forecasting.models.seasonal import SeasonalNaive, SeasonalProfile
from forecasting.models.smoothing import HoltWinters, StlArima
from tests.forecasting.synth import daily_means, intermittent, poisson


def test_seasonal_naive_repeats_an_exact_daily_pattern() -> None:
    y = np.tile(np.arange(24.0), 5)
    fc = SeasonalNaive(24).fit(y).forecast(48)
    np.testing.assert_array_equal(fc.mean, np.tile(np.arange(24.0), 2))
    assert fc.model == "snaive24"


def test_weekly_naive_refuses_short_history() -> None:
    with pytest.raises(FitError, match="at least 168"):
        SeasonalNaive(168).fit(np.ones(100))


def test_profile_median_ignores_a_one_day_burst() -> None:
    y = np.tile(np.arange(24.0) + 10, 4)
    y[48 + 5] = 10_000  # a burst two days ago
    fc = SeasonalProfile(24, seasons=4).fit(y).forecast(24)
    np.testing.assert_allclose(fc.mean, np.arange(24.0) + 10)


@pytest.mark.parametrize("model", [HoltWinters(24, log=True), HoltWinters(24, log=False), StlArima(24),
                                   SeasonalProfile(24, seasons=7, agg="mean")])
def test_seasonal_models_recover_the_daily_cycle(model) -> None:
    means = daily_means(15)
    y = poisson(means[:14 * 24], seed=1)
    fc = model.fit(y).forecast(24)
    truth = means[14 * 24:]
    rel = np.mean(np.abs(fc.mean - truth)) / truth.mean()
    assert rel < 0.15, f"{model.name}: mean relative error {rel:.3f}"
    assert int(np.argmin(fc.mean)) in (3, 4, 5)


def test_tsb_recovers_occurrence_probability_and_size() -> None:
    y = intermittent(2000, p=0.2, size=3.0, seed=2)
    fc = Tsb().fit(y).forecast(5)
    assert fc.p_any[0] == pytest.approx(0.2, abs=0.07)
    assert fc.mean[0] == pytest.approx(0.2 * 3.0, rel=0.35)
    assert np.all(fc.mean == fc.mean[0])
    assert fc.prob_any_in(0, 5) == pytest.approx(1 - (1 - fc.p_any[0]) ** 5)


def test_tsb_on_an_all_zero_series_forecasts_nothing() -> None:
    fc = Tsb().fit(np.zeros(50)).forecast(3)
    assert np.all(fc.mean == 0) and np.all(fc.p_any == 0) and np.all(fc.upper == 0)


def test_forecasts_are_capped_at_twice_the_history_maximum() -> None:
    y = np.ones(72)
    y[-3:] = [50.0, 400.0, 3000.0]  # a steep level jump: the level ratio explodes
    fc = SeasonalProfile(24, seasons=3, level_window=3).fit(y).forecast(24)
    assert fc.mean.max() <= 2 * 3000.0 and fc.upper.max() <= 2 * 3000.0
    assert np.all(fc.lower >= 0) and np.all(fc.lower <= fc.mean) and np.all(fc.mean <= fc.upper)


@pytest.mark.parametrize("model", [SeasonalNaive(24), SeasonalProfile(24, seasons=4), HoltWinters(24, log=False)])
def test_80_percent_intervals_cover_about_80_percent(model) -> None:
    means = daily_means(40, base=60, amp=30)
    hits = total = 0
    for day in range(20, 40, 2):
        y = poisson(means[:day * 24], seed=day)
        fc = model.fit(y).forecast(24, level=0.8)
        actual = poisson(means[day * 24:(day + 1) * 24], seed=1000 + day)
        hits += int(np.sum((actual >= fc.lower) & (actual <= fc.upper)))
        total += 24
    assert 0.65 <= hits / total <= 0.97, f"{model.name}: coverage {hits / total:.2f}"


def test_probability_of_a_request_follows_the_forecast() -> None:
    y = np.tile([0.0, 0.0, 5.0, 0.0], 30)
    fc = SeasonalNaive(4).fit(y).forecast(4)
    np.testing.assert_allclose(fc.p_any, 1 - np.exp(-np.array([0.0, 0.0, 5.0, 0.0])))
    assert fc.prob_any_in(0, 2) == 0.0


def test_ensemble_takes_the_median_and_survives_a_failing_member() -> None:
    y = np.tile(np.arange(24.0), 3)  # 72 points: weekly naive cannot fit
    ens = Ensemble((SeasonalNaive(24), SeasonalNaive(168), WindowMean(24)), "median")
    fc = ens.fit(y).forecast(24)
    expected = np.median(np.stack([np.arange(24.0), np.full(24, 11.5)]), axis=0)
    np.testing.assert_allclose(fc.mean, expected)
    with pytest.raises(FitError, match="every member failed"):
        Ensemble((SeasonalNaive(168),)).fit(y)


def test_candidates_keep_statsmodels_for_dense_series_only() -> None:
    dense = poisson(daily_means(7), seed=3)
    sparse = intermittent(7 * 24, p=0.1, size=2.0, seed=3)
    assert any(m.name == robust_ensemble().name for m in candidates(dense))
    assert not any(isinstance(m, (HoltWinters, StlArima, Ensemble)) for m in candidates(sparse))


@pytest.mark.parametrize("bad, message", [([], "empty"), ([1.0, np.nan], "NaN"), ([1.0, -2.0], "negative"),
                                          ([[1.0]], "1-D")])
def test_bad_series_are_refused_with_a_reason(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_series(bad)


def test_bad_horizon_and_level() -> None:
    fitted = SeasonalNaive(24).fit(np.ones(48))
    with pytest.raises(ValueError, match="positive integer"):
        fitted.forecast(0)
    with pytest.raises(ValueError, match="level"):
        fitted.forecast(3, level=1.5)
