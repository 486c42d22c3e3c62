"""Forecasting models for per-prefix demand: a specification, ``fit`` and ``forecast(h)``.

Every model is a frozen dataclass (the specification). ``fit(y)`` takes one series of
non-negative counts (a 1-D array, oldest first, equally spaced) and returns a
:class:`Fitted`, whose ``forecast(h)`` gives a :class:`Forecast`: the point path, a
prediction interval and the probability of at least one request in each step.

What real traffic taught us (ServeGen, see docs/forecasting.md) shapes the choices:

- seasonal naive (daily) is hard to beat per series; a *median* over the last days of
  the same hour (:class:`SeasonalProfile`) is a robust improvement, because errors are
  scored by absolute value and traffic has bursts;
- models fitted on ``log1p`` counts forecast the median rather than the mean, which
  suits bursty counts, but can explode when back-transformed: every forecast is capped
  at ``cap x`` the largest value in the history (2 by default);
- weekly models need two weeks of history; with less they refuse (``fit`` raises
  :class:`FitError`) and the caller falls back.

The shared types (:class:`Forecast`, :class:`Fitted`, :class:`FitError`) live in
:mod:`forecasting.forecast`, TSB and the window mean in :mod:`forecasting.intermittent`,
ensembles in :mod:`forecasting.ensemble`; all are importable from here.

``statsmodels`` is imported lazily: the cheap models (naive, profile, TSB) need only
numpy, so thousands of sparse series fit in milliseconds each.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np

from forecasting.ensemble import Ensemble
from forecasting.forecast import FitError, Fitted, Forecast, Model, _need, _Repeat, check_series
from forecasting.intermittent import Tsb, WindowMean

# NOTE: Forecast, check_series and the moved models are re-exported: callers import them from here.
__all__ = ["ENSEMBLE", "Ensemble", "FitError", "Fitted", "Forecast", "HoltWinters", "Model", "SeasonalNaive",
           "SeasonalProfile", "StlArima", "Tsb", "WindowMean", "candidates", "check_series", "dense_models",
           "is_dense", "robust_ensemble", "sparse_models"]


def _log(y: np.ndarray, log: bool) -> np.ndarray:
    return np.log1p(y) if log else y


# -- seasonal naive and the multi-day profile -----------------------------------------------


@dataclass(frozen=True)
class SeasonalNaive:
    """Repeat the last season: ``y[t] = y[t - period]`` (24 = daily, 168 = weekly at hourly buckets)."""

    period: int = 24
    cap: float = 2.0

    @property
    def name(self) -> str:
        return f"snaive{self.period}"

    def fit(self, y: np.ndarray) -> Fitted:
        m = self.period
        _need(y, m, self.name)
        diff = y[m:] - y[:-m]
        sd = float(np.sqrt(np.mean(diff**2))) if diff.size else float(np.std(y))
        return _Repeat(y, self.cap, self.name, y[-m:].copy(), sd, log=False)


@dataclass(frozen=True)
class SeasonalProfile:
    """The median (or mean) of the same step over the last ``seasons`` seasons.

    With ``log=True`` the profile is taken over ``log1p`` counts (a geometric-style
    median for ``agg='mean'``). ``level_window`` > 0 rescales the profile by the ratio
    of the last ``level_window`` steps to the profile's values there, following a
    level shift. With fewer than ``seasons`` seasons of history it uses what there is
    (at least one).
    """

    period: int = 24
    seasons: int = 4
    agg: Literal["median", "mean"] = "median"
    log: bool = False
    level_window: int = 0
    cap: float = 2.0

    @property
    def name(self) -> str:
        parts = [f"profile{self.period}x{self.seasons}", self.agg]
        if self.log:
            parts.append("log")
        if self.level_window:
            parts.append(f"lvl{self.level_window}")
        return "-".join(parts)

    def _profile(self, z: np.ndarray) -> np.ndarray:
        m = self.period
        k = min(self.seasons, z.size // m)
        block = z[z.size - k * m:].reshape(k, m)
        return np.median(block, axis=0) if self.agg == "median" else block.mean(axis=0)

    def fit(self, y: np.ndarray) -> Fitted:
        m = self.period
        _need(y, m, self.name)
        z = _log(y, self.log)
        prof = self._profile(z)
        if self.level_window:
            w = min(self.level_window, m)
            recent, base = z[-w:].sum(), prof[-w:].sum()
            if base > 0 and recent > 0:
                prof = prof * (recent / base)
        # NOTE: spread from true out-of-sample errors: each of the last few seasons
        # against the profile of the seasons before it.
        errs = []
        for back in range(1, 4):
            end = z.size - back * m
            if end < m:
                break
            errs.append(z[end:end + m] - self._profile(z[:end]))
        sd = float(np.sqrt(np.mean(np.concatenate(errs) ** 2))) if errs else float(np.std(z))
        return _Repeat(y, self.cap, self.name, prof, sd, log=self.log)


# -- Holt-Winters ----------------------------------------------------------------------------


def _param(params: dict, key: str) -> float:
    v = params.get(key)
    return float(v) if v is not None and math.isfinite(float(v)) else 0.0  # statsmodels gives NaN for unused ones


class _HoltWinters(Fitted):
    def __init__(self, y: np.ndarray, cap: float, name: str, res, params: dict, period: int, sd: float, log: bool) -> None:
        super().__init__(y, cap)
        self.name, self.res, self.period, self.sd, self.log_space = name, res, period, sd, log
        self.alpha, self.beta, self.gamma = (_param(params, k) for k in ("smoothing_level", "smoothing_trend",
                                                                        "smoothing_seasonal"))

    def _path(self, h: int) -> np.ndarray:
        return np.asarray(self.res.forecast(h), dtype=np.float64)

    def _spread(self, h: int) -> np.ndarray:
        # Additive Holt-Winters h-step variance (Hyndman & Athanasopoulos, table 6.7):
        # sigma^2 * (1 + sum_{j<h} (alpha (1 + j beta) + gamma [j mod m == 0])^2)
        j = np.arange(1, h)
        c = self.alpha * (1 + j * self.beta) + self.gamma * (j % self.period == 0)
        var = 1.0 + np.concatenate([[0.0], np.cumsum(c**2)])
        return self.sd * np.sqrt(var)


@dataclass(frozen=True)
class HoltWinters:
    """Additive Holt-Winters (statsmodels ``ExponentialSmoothing``), optionally on ``log1p`` counts.

    ``days`` > 0 fits only the last ``days`` seasons (recent behaviour, and faster).
    Heuristic initialisation without brute-force search keeps a fit near 10 ms.
    """

    period: int = 24
    trend: Literal["add"] | None = None
    damped: bool = False
    log: bool = True
    days: int = 0
    cap: float = 2.0

    @property
    def name(self) -> str:
        t = "" if self.trend is None else ("-damped" if self.damped else "-trend")
        d = f"-{self.days}d" if self.days else ""
        return f"hw{self.period}{t}{'-log' if self.log else ''}{d}"

    def fit(self, y: np.ndarray) -> Fitted:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        m = self.period
        x = y[-self.days * m:] if self.days else y
        _need(x, 2 * m + 1, self.name)
        z = _log(x, self.log)
        if np.ptp(z) == 0:
            raise FitError(f"{self.name}: a constant series has nothing to smooth")
        init = "heuristic" if z.size >= 4 * m else "estimated"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = ExponentialSmoothing(z, trend=self.trend, damped_trend=self.damped and self.trend is not None,
                                           seasonal="add", seasonal_periods=m,
                                           initialization_method=init).fit(use_brute=False)
        except (ValueError, np.linalg.LinAlgError) as exc:
            raise FitError(f"{self.name}: statsmodels failed: {exc}") from None
        resid = z - np.asarray(res.fittedvalues)
        sd = float(np.sqrt(np.mean(resid[m:] ** 2)))
        if not math.isfinite(sd):
            raise FitError(f"{self.name}: the fit diverged")
        return _HoltWinters(y, self.cap, self.name, res, dict(res.params), m, sd, self.log)


# -- STL + ARIMA --------------------------------------------------------------------------


class _Stl(Fitted):
    def __init__(self, y: np.ndarray, cap: float, name: str, res, log: bool) -> None:
        super().__init__(y, cap)
        self.name, self.res, self.log_space = name, res, log
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None

    def _pred(self, h: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cache is None or self._cache[0] != h:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pred = self.res.get_prediction(start=self.n, end=self.n + h - 1)
            mean = np.asarray(pred.predicted_mean, dtype=np.float64)
            sd = np.sqrt(np.asarray(pred.var_pred_mean, dtype=np.float64))
            self._cache = (h, mean, sd)
        return self._cache[1], self._cache[2]

    def _path(self, h: int) -> np.ndarray:
        return self._pred(h)[0]

    def _spread(self, h: int) -> np.ndarray:
        return self._pred(h)[1]


@dataclass(frozen=True)
class StlArima:
    """STL decomposition (robust) with an ARIMA on the seasonally adjusted series (statsmodels ``STLForecast``).

    The seasonal component is carried forward; the ARIMA forecasts the rest. About
    20 ms a fit on two weeks of hourly data.
    """

    period: int = 24
    order: tuple[int, int, int] = (1, 0, 0)
    log: bool = True
    cap: float = 2.0

    @property
    def name(self) -> str:
        p, d, q = self.order
        return f"stl{self.period}-arima{p}{d}{q}{'-log' if self.log else ''}"

    def fit(self, y: np.ndarray) -> Fitted:
        from statsmodels.tsa.arima.model import ARIMA
        from statsmodels.tsa.forecasting.stl import STLForecast

        m = self.period
        _need(y, 2 * m + 1, self.name)
        z = _log(y, self.log)
        if np.ptp(z) == 0:
            raise FitError(f"{self.name}: a constant series has nothing to decompose")
        trend = "c" if self.order[1] == 0 else "n"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = STLForecast(z, ARIMA, period=m, robust=True,
                                  model_kwargs={"order": self.order, "trend": trend}).fit()
        except (ValueError, np.linalg.LinAlgError) as exc:
            raise FitError(f"{self.name}: statsmodels failed: {exc}") from None
        return _Stl(y, self.cap, self.name, res, self.log)


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
