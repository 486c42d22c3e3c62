"""The catalogue of candidate models: which models compete for a series, dense or sparse.

Every model is a frozen dataclass (the specification) whose ``fit(y)`` returns a
:class:`~forecasting.models.base.Fitted` with ``forecast(h)`` (:mod:`forecasting.models.base`).
The candidates come from :mod:`forecasting.models.seasonal`, :mod:`forecasting.models.smoothing`
(statsmodels), :mod:`forecasting.models.intermittent` and :mod:`forecasting.models.ensemble`;
:mod:`forecasting.models.selection` picks among them per series by backtest.
"""
from __future__ import annotations

import numpy as np

from forecasting.models.base import Model
from forecasting.models.ensemble import Ensemble
from forecasting.models.intermittent import Tsb, WindowMean
from forecasting.models.seasonal import SeasonalNaive, SeasonalProfile
from forecasting.models.smoothing import HoltWinters

#: the label of :func:`robust_ensemble`, the model the per-series choice prefers
ENSEMBLE = "ensemble"


def robust_ensemble(period: int = 24) -> Ensemble:
    """Median of seasonal naive, the 4-season median profile and Holt-Winters on log counts (last 7 seasons).

    Three different views of the next day (yesterday, the usual day, a smoothed
    level-plus-season); their median is rarely far off when one of them is.
    """
    return Ensemble((SeasonalNaive(period), SeasonalProfile(period, seasons=4), HoltWinters(period, log=True, days=7)),
                    "median", label=ENSEMBLE)


def dense_models(period: int = 24) -> tuple[Model, ...]:
    """Candidates for a series with traffic in most buckets (statsmodels fits included)."""
    return (
        SeasonalNaive(period),
        SeasonalProfile(period, seasons=4),
        SeasonalProfile(period, seasons=4, log=True),
        HoltWinters(period, log=True, days=7),
        Tsb(),
        robust_ensemble(period),
    )


def sparse_models(period: int = 24) -> tuple[Model, ...]:
    """Candidates for a sparse, intermittent series: numpy only, about a millisecond a fit."""
    return (SeasonalNaive(period), SeasonalProfile(period, seasons=4), SeasonalProfile(period, seasons=7, agg="mean"),
            Tsb(), WindowMean(period))


def is_dense(y: np.ndarray, period: int = 24, *, min_nonzero: float = 0.5) -> bool:
    """At least ``min_nonzero`` of the buckets have traffic and there are 3 periods of history."""
    return y.size >= 3 * period and float(np.mean(y > 0)) >= min_nonzero


def candidates(y: np.ndarray, period: int = 24) -> tuple[Model, ...]:
    """The candidate models for one series: :func:`dense_models` or :func:`sparse_models`.

    Keeps statsmodels for the series where it pays: 10,000 sparse prefixes then fit
    in minutes on two cores.
    """
    return dense_models(period) if is_dense(y, period) else sparse_models(period)
