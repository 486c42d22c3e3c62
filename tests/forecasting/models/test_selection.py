"""Per-series choice by rolling-origin MASE, fallbacks, and forecasting whole tables."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from forecasting.models.base import FitError
from forecasting.models.catalog import candidates
from forecasting.models.intermittent import Tsb, WindowMean
from forecasting.models.parallel import forecast_frame_parallel
from forecasting.models.seasonal import SeasonalNaive, SeasonalProfile
from forecasting.models.selection import (
    BacktestSpec,
    backtest,
    forecast_frame,
    forecast_series,
    mase,
    mase_scale,
    origins,
)
from tests.forecasting.synth import daily_means, intermittent, long_table, poisson


@dataclass(frozen=True)
class Failing:
    """A model whose fit fails on histories longer than ``above`` (all when 0)."""

    above: int = 0

    @property
    def name(self) -> str:
        return f"failing{self.above}"

    def fit(self, y: np.ndarray):
        if y.size > self.above:
            raise FitError("solver did not converge")
        return SeasonalNaive(24).fit(y)


PLAIN = BacktestSpec(prefer=None, margin=1.0)


def test_mase_by_hand() -> None:
    y = np.array([1.0, 2.0, 4.0, 2.0, 3.0, 5.0])
    assert mase_scale(y, 3) == pytest.approx((1 + 1 + 1) / 3)
    assert mase(np.array([2.0, 4.0]), np.array([3.0, 1.0]), 2.0) == pytest.approx((1 + 3) / 2 / 2.0)
    assert mase_scale(np.zeros(5), 3) == 1.0
    with pytest.raises(ValueError, match="shape"):
        mase(np.ones(2), np.ones(3), 1.0)


def test_origins_roll_back_from_the_end() -> None:
    assert origins(240, BacktestSpec(horizon=24, origins=3, step=24)) == [168, 192, 216]
    assert origins(60, BacktestSpec(horizon=24, origins=3, step=24, min_train=30)) == [36]


def test_backtest_picks_the_model_that_matches_the_structure() -> None:
    seasonal = np.tile(np.arange(24.0), 10)
    sf = forecast_series(seasonal, [WindowMean(24), SeasonalNaive(24)], 24, PLAIN)
    assert sf.model == "snaive24" and sf.scores["snaive24"] == 0.0 and not sf.fallback
    sparse = intermittent(24 * 14, p=0.05, size=2.0, seed=4)
    sf = forecast_series(sparse, [SeasonalNaive(24), Tsb()], 24, PLAIN)
    assert sf.model == "tsb"


def test_preferred_model_is_kept_unless_clearly_beaten() -> None:
    y = poisson(daily_means(10), seed=5)
    models = [SeasonalNaive(24), SeasonalProfile(24, seasons=4)]
    scores = backtest(y, models, PLAIN).scores
    best, worst = sorted(scores, key=scores.get)
    keep = BacktestSpec(prefer=worst, margin=min(0.99, scores[best] / scores[worst] - 1e-6))
    assert forecast_series(y, models, 24, keep).model == worst
    beat = BacktestSpec(prefer=worst, margin=1.0)
    assert forecast_series(y, models, 24, beat).model == best


def test_a_failing_model_is_never_chosen_and_its_reason_is_kept() -> None:
    y = poisson(daily_means(6), seed=6)
    sf = forecast_series(y, [Failing(), WindowMean(24)], 24, PLAIN)
    assert sf.model == "mean24" and sf.scores["failing0"] == float("inf")
    assert "did not converge" in sf.failures["failing0"]


def test_fallback_when_the_final_fit_fails() -> None:
    y = poisson(daily_means(6), seed=7)
    # fits in the backtest (short histories) but not on the whole series
    sf = forecast_series(y, [Failing(above=y.size - 1)], 24, PLAIN)
    assert sf.fallback and sf.model == "snaive24"
    sf = forecast_series(np.ones(10), [Failing()], 5, PLAIN)  # too short for seasonal naive too
    assert sf.model == "mean24" and np.allclose(sf.forecast.mean, 1.0)
    with pytest.raises(FitError, match="every model failed"):
        forecast_series(np.ones(10), [Failing()], 5, PLAIN, fallback=())


def test_short_history_uses_the_preferred_model_without_evidence() -> None:
    sf = forecast_series(np.arange(30.0), [WindowMean(24), SeasonalNaive(24)], 24,
                         BacktestSpec(prefer="snaive24"))
    assert sf.model == "snaive24" and all(np.isnan(v) for v in sf.scores.values())


def test_forecast_frame_continues_every_series_from_the_common_end() -> None:
    df = long_table({"a": poisson(daily_means(5), seed=8), "b": intermittent(5 * 24, 0.2, 3.0, seed=8)})
    df = df[~((df["unique_id"] == "b") & (df["ds"] >= df["ds"].max() - pd.Timedelta(hours=2)))]  # b stops early
    out = forecast_frame(df, candidates, 24)
    assert set(out.columns) >= {"unique_id", "ds", "y_hat", "lower", "upper", "p_any", "model", "fallback"}
    first = out.groupby("unique_id")["ds"].min()
    assert (first == df["ds"].max() + pd.Timedelta(hours=1)).all()
    assert out.groupby("unique_id").size().tolist() == [24, 24]
    assert (out["lower"] <= out["y_hat"]).all() and (out["y_hat"] <= out["upper"]).all()


def test_parallel_matches_serial() -> None:
    df = long_table({f"s{i}": poisson(daily_means(4, base=5 + i, amp=3), seed=i) for i in range(6)})
    models = [SeasonalNaive(24), SeasonalProfile(24, seasons=3), Tsb()]
    serial = forecast_frame(df, models, 12, PLAIN)
    par = forecast_frame_parallel(df, models, 12, PLAIN, workers=2, chunk=2)
    pd.testing.assert_frame_equal(serial, par)


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="missing column"):
        forecast_frame(pd.DataFrame({"ds": [], "y": []}), candidates, 3)
    df = long_table({"a": np.ones(3)})
    with pytest.raises(ValueError, match="duplicate"):
        forecast_frame(pd.concat([df, df]), candidates, 3)
