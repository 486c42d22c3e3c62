"""Models fitted with statsmodels: Holt-Winters exponential smoothing and STL + ARIMA.

Fitted on ``log1p`` counts (optionally) they forecast the median rather than the mean,
which suits bursty counts, but can explode when back-transformed: every forecast is
capped at ``cap x`` the largest value in the history (2 by default). Weekly models need
two weeks of history; with less ``fit`` raises :class:`~forecasting.models.base.FitError`
and the caller falls back. ``statsmodels`` is imported inside ``fit``, so a process that
only runs the numpy models never loads it.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np

from forecasting.models.base import FitError, Fitted, _need, log_counts

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
        z = log_counts(x, self.log)
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
        z = log_counts(y, self.log)
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
