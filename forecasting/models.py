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

``statsmodels`` is imported lazily: the cheap models (naive, profile, TSB) need only
numpy, so thousands of sparse series fit in milliseconds each.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Protocol, Sequence

import numpy as np

#: z-scores of the central interval levels used most; others via the normal quantile
_Z = {0.5: 0.6745, 0.8: 1.2816, 0.9: 1.6449, 0.95: 1.9600}


class FitError(ValueError):
    """A model cannot be fitted to this series (too short, degenerate, or the solver failed)."""


def _z(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"interval level must be in (0, 1), got {level!r}")
    if level in _Z:
        return _Z[level]
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + level / 2.0)


def check_series(y: Sequence[float] | np.ndarray, *, name: str = "series") -> np.ndarray:
    """``y`` as a float64 1-D array of finite, non-negative values, or a ``ValueError`` saying what is wrong."""
    a = np.asarray(y, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D series of counts, got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name}: the series is empty")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: the series holds NaN or infinite values; fill missing buckets with 0")
    if np.any(a < 0):
        raise ValueError(f"{name}: the series holds negative counts")
    return a


@dataclass(frozen=True)
class Forecast:
    """A forecast of ``h`` steps: point path, central interval at ``level``, P(at least one request)."""

    mean: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    p_any: np.ndarray
    level: float
    model: str

    def __len__(self) -> int:
        return int(self.mean.shape[0])

    def prob_any_in(self, start: int = 0, stop: int | None = None) -> float:
        """Probability of at least one request in steps ``[start, stop)`` (steps taken as independent)."""
        p = self.p_any[start:stop]
        return float(1.0 - np.prod(1.0 - p)) if p.size else 0.0


class Fitted:
    """A fitted model. Subclasses give the point path and the spread of its errors.

    ``forecast`` caps every value at ``cap x max(history)`` and clips at zero, builds
    the interval and the probability of a request. Intervals come from ``_spread``: a
    standard deviation per step, on the original scale or (``log_space``) on ``log1p``.
    """

    name: str = "fitted"
    log_space: bool = False

    def __init__(self, y: np.ndarray, cap: float) -> None:
        self.n = y.size
        self.history_max = float(y.max())
        self.cap = cap

    # -- what subclasses give ------------------------------------------------------------
    def _path(self, h: int) -> np.ndarray:  # on the model's scale (log1p when log_space)
        raise NotImplementedError

    def _spread(self, h: int) -> np.ndarray:  # per-step std of the error on the same scale
        raise NotImplementedError

    def _bounds(self, path: np.ndarray, h: int, level: float, z: float) -> tuple[np.ndarray, np.ndarray]:
        sd = np.asarray(self._spread(h), dtype=np.float64)
        sd = np.where(np.isfinite(sd), np.maximum(sd, 0.0), 0.0)
        return path - z * sd, path + z * sd

    def _p_any(self, mean: np.ndarray) -> np.ndarray:
        # NOTE: Poisson with the forecast as its mean: P(N >= 1) = 1 - exp(-mean).
        return 1.0 - np.exp(-mean)

    # -- the common part -------------------------------------------------------------------
    def forecast(self, h: int, level: float = 0.8) -> Forecast:
        """Forecast ``h`` steps after the end of the history.

        Raises:
            ValueError: ``h`` is not a positive integer or ``level`` is outside (0, 1).
            FitError: the model produced non-finite values.
        """
        if not isinstance(h, (int, np.integer)) or h <= 0:
            raise ValueError(f"horizon h must be a positive integer, got {h!r}")
        z = _z(level)
        path = np.asarray(self._path(int(h)), dtype=np.float64)
        if path.shape != (h,) or not np.all(np.isfinite(path)):
            raise FitError(f"{self.name}: the forecast is not {h} finite values")
        lo, hi = self._bounds(path, int(h), level, z)
        if self.log_space:
            with np.errstate(over="ignore"):
                path, lo, hi = np.expm1(path), np.expm1(lo), np.expm1(hi)
        ceiling = self.cap * max(self.history_max, 1.0)
        mean = np.clip(path, 0.0, ceiling)
        lower = np.clip(lo, 0.0, mean)
        upper = np.clip(hi, mean, max(ceiling, 1.0))
        p = np.clip(self._p_any(mean), 0.0, 1.0)
        return Forecast(mean, lower, upper, p, level, self.name)


class Model(Protocol):
    """A forecasting model specification."""

    @property
    def name(self) -> str: ...

    def fit(self, y: np.ndarray) -> Fitted: ...


def _need(y: np.ndarray, n: int, what: str) -> None:
    if y.size < n:
        raise FitError(f"{what} needs at least {n} points of history, got {y.size}")


def _log(y: np.ndarray, log: bool) -> np.ndarray:
    return np.log1p(y) if log else y


# -- seasonal naive and the multi-day profile -----------------------------------------------


class _Repeat(Fitted):
    def __init__(self, y: np.ndarray, cap: float, name: str, season_path: np.ndarray, sd: float, log: bool) -> None:
        super().__init__(y, cap)
        self.name, self.season_path, self.sd, self.log_space = name, season_path, sd, log

    def _path(self, h: int) -> np.ndarray:
        reps = -(-h // self.season_path.size)
        return np.tile(self.season_path, reps)[:h]

    def _spread(self, h: int) -> np.ndarray:
        # NOTE: the k-th season ahead repeats a value k seasons old: the error grows like sqrt(k).
        k = np.arange(h) // self.season_path.size + 1
        return self.sd * np.sqrt(k)


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


# -- intermittent demand: Croston / TSB --------------------------------------------------


class _Tsb(Fitted):
    def __init__(self, y: np.ndarray, cap: float, name: str, p: float, size: float, size_sd: float) -> None:
        super().__init__(y, cap)
        self.name, self.p, self.size, self.size_sd = name, p, size, size_sd

    def _path(self, h: int) -> np.ndarray:
        return np.full(h, self.p * self.size)

    def _bounds(self, path: np.ndarray, h: int, level: float, z: float) -> tuple[np.ndarray, np.ndarray]:
        # NOTE: demand in a step is 0 with probability 1 - p, else about the mean size:
        # the interval's ends are quantiles of that mixture, not mean +- z sd.
        from statistics import NormalDist

        def quantile(q: float) -> float:
            if q <= 1.0 - self.p or self.p <= 0.0:
                return 0.0
            inner = min(max((q - (1.0 - self.p)) / self.p, 1e-9), 1 - 1e-9)
            return max(self.size + self.size_sd * NormalDist().inv_cdf(inner), 0.0)

        tail = (1.0 - level) / 2.0
        return np.full(h, quantile(tail)), np.full(h, quantile(1.0 - tail))

    def _spread(self, h: int) -> np.ndarray:  # pragma: no cover - _bounds is overridden
        return np.zeros(h)

    def _p_any(self, mean: np.ndarray) -> np.ndarray:
        return np.full(mean.shape, self.p)


def _tsb_filter(y: np.ndarray, alpha: np.ndarray, beta: np.ndarray, p0: float, z0: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run TSB over ``y`` for every (alpha, beta) pair at once.

    Returns the final p, size and one-step squared error sum, one per pair. One Python
    loop over time for the whole grid keeps a fit near a millisecond.
    """
    p = np.full(alpha.shape, p0)
    z = np.full(alpha.shape, z0)
    sse = np.zeros(alpha.shape)
    for v in y.tolist():
        e = v - p * z
        sse += e * e
        if v > 0:
            p += beta * (1.0 - p)
            z += alpha * (v - z)
        else:
            p -= beta * p
    return p, z, sse


@dataclass(frozen=True)
class Tsb:
    """Teunter-Syntetos-Babai: Croston's method with a demand probability updated every step.

    Suits sparse, intermittent demand (most prefixes). Forecast = p x size, flat;
    ``p`` is the probability of at least one request in a step. ``alpha`` (size) and
    ``beta`` (probability) are chosen from a small grid by one-step squared error
    unless given.
    """

    alpha: float | None = None
    beta: float | None = None
    cap: float = 2.0
    grid: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3)

    @property
    def name(self) -> str:
        return "tsb"

    def fit(self, y: np.ndarray) -> Fitted:
        _need(y, 2, self.name)
        nz = y[y > 0]
        if nz.size == 0:
            return _Tsb(y, self.cap, self.name, 0.0, 0.0, 0.0)
        p0 = nz.size / y.size
        z0 = float(nz[: max(1, nz.size // 4)].mean())
        alphas = self.grid if self.alpha is None else (self.alpha,)
        betas = self.grid if self.beta is None else (self.beta,)
        a, b = (np.asarray(g, dtype=np.float64).ravel() for g in np.meshgrid(alphas, betas, indexing="ij"))
        ps, zs, sse = _tsb_filter(y, a, b, p0, z0)
        best = int(np.argmin(sse))  # first of equals: the grid order decides ties
        p, z = float(ps[best]), float(zs[best])
        size_sd = float(nz.std()) if nz.size > 1 else 0.0
        return _Tsb(y, self.cap, self.name, float(min(max(p, 0.0), 1.0)), float(z), size_sd)


# -- a simple mean, the last fallback ------------------------------------------------------


@dataclass(frozen=True)
class WindowMean:
    """The mean of the last ``window`` steps, flat. Never fails on a non-empty series: the last fallback."""

    window: int = 24
    cap: float = 2.0

    @property
    def name(self) -> str:
        return f"mean{self.window}"

    def fit(self, y: np.ndarray) -> Fitted:
        x = y[-self.window:]
        return _Repeat(y, self.cap, self.name, np.array([x.mean()]), float(x.std()), log=False)


# -- ensembles -----------------------------------------------------------------------------


class _Ensemble(Fitted):
    def __init__(self, y: np.ndarray, cap: float, name: str, members: list[Fitted], agg: str) -> None:
        super().__init__(y, cap)
        self.name, self.members, self.agg = name, members, agg

    def forecast(self, h: int, level: float = 0.8) -> Forecast:
        fcs = [m.forecast(h, level) for m in self.members]
        combine: Callable[..., np.ndarray] = np.median if self.agg == "median" else np.mean
        mean = combine(np.stack([f.mean for f in fcs]), axis=0)
        lower = np.minimum(combine(np.stack([f.lower for f in fcs]), axis=0), mean)
        upper = np.maximum(combine(np.stack([f.upper for f in fcs]), axis=0), mean)
        p = np.clip(combine(np.stack([f.p_any for f in fcs]), axis=0), 0.0, 1.0)
        return Forecast(mean, lower, upper, p, level, self.name)


@dataclass(frozen=True)
class Ensemble:
    """The step-wise median (or mean) of several models' forecasts.

    Members whose fit fails are left out; the ensemble fails only when all do. A median
    of seasonal naive, the multi-day profile and a log-scale model is robust to any one
    of them going wrong on a given day.
    """

    members: tuple[Model, ...]
    agg: Literal["median", "mean"] = "median"
    label: str = ""
    cap: float = 2.0

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("an Ensemble needs at least one member model")
        if self.agg not in ("median", "mean"):
            raise ValueError(f"Ensemble agg must be 'median' or 'mean', got {self.agg!r}")

    @property
    def name(self) -> str:
        return self.label or f"{self.agg}(" + ",".join(m.name for m in self.members) + ")"

    def fit(self, y: np.ndarray, fit_member: Callable[[Model, np.ndarray], Fitted] | None = None) -> Fitted:
        """Fit every member (through ``fit_member`` when given: a backtest shares member fits)."""
        fitted, errors = [], []
        for m in self.members:
            try:
                fitted.append(fit_member(m, y) if fit_member else m.fit(y))
            except FitError as exc:
                errors.append(str(exc))
        if not fitted:
            raise FitError(f"{self.name}: every member failed: {'; '.join(errors)}")
        return _Ensemble(y, self.cap, self.name, fitted, self.agg)


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
