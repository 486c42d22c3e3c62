"""Per-series model choice by rolling-origin backtest, scored by MASE, with fallbacks.

For each series, every candidate model is fitted at a few origins in the recent past
and forecasts the ``horizon`` steps after each; its errors are scaled by the
in-sample seasonal naive error (MASE). The best-scoring candidate is refitted on the
whole history and forecasts ahead. A candidate that fails to fit scores infinity; if
the chosen model fails on the final fit, the next best is used, and in the end the
``fallback`` models (seasonal naive, then a plain mean) which cannot fail on a
non-empty series.

``prefer`` names a model that wins unless another beats it by a margin: with only a
few origins, the backtest's ranking is noisy, and a robust ensemble that is rarely
bad is worth more than a model that was lucky on three days.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import numpy as np
import pandas as pd

from forecasting.models.base import FitError, Fitted, Forecast, Model, check_series
from forecasting.models.catalog import ENSEMBLE
from forecasting.models.ensemble import Ensemble
from forecasting.models.intermittent import WindowMean
from forecasting.models.seasonal import SeasonalNaive

#: candidates for one series: a fixed list, or a function of the series (default :func:`forecasting.models.catalog.candidates`)
Models = Union[Sequence[Model], Callable[[np.ndarray], Sequence[Model]]]


@dataclass(frozen=True)
class BacktestSpec:
    """How candidates are compared.

    Attributes:
        horizon: steps forecast from each origin (24 = a day of hourly buckets).
        origins: how many rolling origins; the last is ``horizon`` steps before the end.
        step: steps between consecutive origins.
        season: period of the seasonal naive error that scales MASE.
        min_train: an origin needs at least this much history before it.
        prefer: a model name that is kept unless another scores below ``margin`` x its score.
        margin: see ``prefer`` (1.0 = plain minimum).
    """

    horizon: int = 24
    origins: int = 3
    step: int = 24
    season: int = 24
    min_train: int = 48
    prefer: str | None = ENSEMBLE
    margin: float = 0.8

    def __post_init__(self) -> None:
        for name in ("horizon", "origins", "step", "season", "min_train"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"BacktestSpec.{name} must be a positive integer, got {v!r}")
        if not 0.0 < self.margin <= 1.0:
            raise ValueError(f"BacktestSpec.margin must be in (0, 1], got {self.margin!r}")


def mase_scale(y: np.ndarray, season: int) -> float:
    """Mean absolute in-sample error of the seasonal naive forecast (the MASE denominator).

    Falls back to the lag-1 error, then to the mean level, then to 1, so that a short or
    flat series still gets a positive scale.
    """
    for lag in (season, 1):
        if y.size > lag:
            s = float(np.mean(np.abs(y[lag:] - y[:-lag])))
            if s > 0:
                return s
    m = float(np.mean(np.abs(y))) if y.size else 0.0
    return m if m > 0 else 1.0


def mase(actual: np.ndarray, predicted: np.ndarray, scale: float) -> float:
    """Mean absolute error of ``predicted`` scaled by ``scale`` (see :func:`mase_scale`)."""
    a, p = np.asarray(actual, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    if a.shape != p.shape:
        raise ValueError(f"actual {a.shape} and predicted {p.shape} differ in shape")
    if not scale > 0:
        raise ValueError(f"MASE scale must be positive, got {scale!r}")
    return float(np.mean(np.abs(a - p)) / scale)


def origins(n: int, spec: BacktestSpec) -> list[int]:
    """The backtest origins (history lengths) for a series of length ``n``, oldest first."""
    out = [n - spec.horizon - i * spec.step for i in range(spec.origins)]
    return sorted(o for o in out if o >= spec.min_train)


@dataclass(frozen=True)
class BacktestResult:
    """Scores (mean MASE over origins; ``inf`` when the model failed) and why models failed."""

    scores: dict[str, float]
    failures: dict[str, str]
    origins: tuple[int, ...]

    def ranking(self) -> list[str]:
        return sorted(self.scores, key=lambda k: (self.scores[k], k))


def backtest(y: Sequence[float] | np.ndarray, models: Sequence[Model], spec: BacktestSpec = BacktestSpec()) -> BacktestResult:
    """Score each model by rolling-origin MASE on ``y``.

    With history too short for any origin, every model scores NaN (no evidence) and the
    choice falls to ``prefer`` or the first model.
    """
    a = check_series(y)
    scale = mase_scale(a, spec.season)
    orig = origins(a.size, spec)
    scores: dict[str, float] = {}
    failures: dict[str, str] = {}
    cache: dict[tuple[Model, int], Fitted | Exception] = {}

    def fit(m: Model, x: np.ndarray) -> Fitted:
        # NOTE: an ensemble's members are often candidates too: fit each (model, origin) once.
        key = (m, x.size)
        if key not in cache:
            try:
                cache[key] = m.fit(x, fit) if isinstance(m, Ensemble) else m.fit(x)
            except (FitError, ValueError, ArithmeticError, np.linalg.LinAlgError) as exc:
                cache[key] = exc
        got = cache[key]
        if isinstance(got, Exception):
            raise got
        return got

    for m in models:
        if not orig:
            scores[m.name] = math.nan
            continue
        errs = []
        try:
            for o in orig:
                fc = fit(m, a[:o]).forecast(spec.horizon)
                errs.append(mase(a[o:o + spec.horizon], fc.mean, scale))
            scores[m.name] = float(np.mean(errs))
        except (FitError, ValueError, ArithmeticError, np.linalg.LinAlgError) as exc:
            scores[m.name] = math.inf
            failures[m.name] = f"{type(exc).__name__}: {exc}"
    return BacktestResult(scores, failures, tuple(orig))


def choose(result: BacktestResult, models: Sequence[Model], spec: BacktestSpec) -> list[Model]:
    """Candidates in the order they should be tried: the choice first."""
    by_name = {m.name: m for m in models}
    finite = {k: v for k, v in result.scores.items() if math.isfinite(v)}
    if not finite:
        # No evidence (short history) or every model failed in the backtest: the
        # preferred model, then the given order.
        order = [m.name for m in models if not math.isinf(result.scores.get(m.name, math.nan))]
        if spec.prefer in order:
            order.remove(spec.prefer)
            order.insert(0, spec.prefer)
        return [by_name[k] for k in order]
    ranked = sorted(finite, key=lambda k: (finite[k], k))
    if spec.prefer in finite and finite[ranked[0]] >= spec.margin * finite[spec.prefer]:
        ranked.remove(spec.prefer)
        ranked.insert(0, spec.prefer)
    return [by_name[k] for k in ranked]


@dataclass(frozen=True)
class SeriesForecast:
    """The forecast of one series and how it was made."""

    forecast: Forecast
    model: str
    scores: dict[str, float]
    fallback: bool
    failures: dict[str, str] = field(default_factory=dict)


DEFAULT_FALLBACK: tuple[Model, ...] = (SeasonalNaive(24), WindowMean(24))


def forecast_series(y: Sequence[float] | np.ndarray, models: Models, h: int,
                    spec: BacktestSpec = BacktestSpec(), *, level: float = 0.8,
                    fallback: Sequence[Model] = DEFAULT_FALLBACK) -> SeriesForecast:
    """Choose a model for ``y`` by backtest and forecast ``h`` steps with it.

    ``fallback`` models are tried, in order, after every candidate failed the final fit;
    ``fallback`` is ``True`` in the result when the model used was not the first choice.

    Raises:
        ValueError: ``y`` is empty, negative or non-finite, or ``models`` is empty.
        FitError: every candidate and every fallback failed.
    """
    a = check_series(y)
    models = list(models(a) if callable(models) else models)
    if not models:
        raise ValueError("forecast_series needs at least one candidate model")
    result = backtest(a, models, spec)
    order = choose(result, models, spec)
    tried = {m.name for m in order}
    order += [m for m in fallback if m.name not in tried]
    failures = dict(result.failures)
    for i, m in enumerate(order):
        try:
            fc = m.fit(a).forecast(h, level)
        except (FitError, ArithmeticError, np.linalg.LinAlgError) as exc:
            failures[m.name] = f"{type(exc).__name__}: {exc}"
            continue
        return SeriesForecast(fc, m.name, result.scores, fallback=i > 0, failures=failures)
    raise FitError(f"every model failed on this series: {failures}")


def future_index(last: pd.Timestamp, freq: pd.Timedelta, h: int) -> pd.DatetimeIndex:
    """The ``h`` bucket starts after ``last``."""
    return pd.DatetimeIndex([last + freq * (i + 1) for i in range(h)])


def infer_bucket(df: pd.DataFrame) -> pd.Timedelta:
    """The bucket length of a long table: the smallest gap between consecutive ``ds`` of any series."""
    ds = pd.DatetimeIndex(df["ds"].unique()).sort_values()
    if ds.size < 2:
        raise ValueError("cannot infer the bucket from fewer than two distinct ds; pass freq")
    # Timedelta arithmetic, not raw int64: the index may hold ns, us or s (pandas >= 3 infers coarser units)
    return pd.Timedelta((ds[1:] - ds[:-1]).min())


def check_long(df: pd.DataFrame, name: str = "demand") -> None:
    """Raise ``ValueError`` unless ``df`` is a long table with ``unique_id``, ``ds``, ``y``."""
    missing = {"unique_id", "ds", "y"} - set(df.columns)
    if missing:
        raise ValueError(f"{name}: missing column(s) {sorted(missing)}; expected a long table (unique_id, ds, y)")
    if df.duplicated(["unique_id", "ds"]).any():
        raise ValueError(f"{name}: duplicate (unique_id, ds) rows; aggregate them first")


def series_arrays(df: pd.DataFrame, freq: pd.Timedelta) -> dict[str, tuple[pd.Timestamp, np.ndarray]]:
    """Each series as (last ds, dense array with missing buckets as zeros).

    Every series runs to the latest ``ds`` of the table (zeros after its own last row),
    so all forecasts start at the same bucket.
    """
    if df.empty:
        return {}
    end = pd.Timestamp(df["ds"].max())
    out: dict[str, tuple[pd.Timestamp, np.ndarray]] = {}
    for uid, g in df.sort_values("ds").groupby("unique_id", sort=True):
        ds = pd.DatetimeIndex(g["ds"])
        pos = ((ds - ds[0]) // freq).to_numpy(dtype=np.int64)
        y = np.zeros(int((end - ds[0]) // freq) + 1)
        y[pos] = g["y"].to_numpy(dtype=np.float64)
        out[str(uid)] = (end, y)
    return out


def frame_rows(uid: str, last: pd.Timestamp, freq: pd.Timedelta, sf: SeriesForecast) -> pd.DataFrame:
    """One series' forecast as rows of the forecast long table."""
    fc = sf.forecast
    return pd.DataFrame({
        "unique_id": uid, "ds": future_index(last, freq, len(fc)), "y_hat": fc.mean,
        "lower": fc.lower, "upper": fc.upper, "p_any": fc.p_any, "model": sf.model, "fallback": sf.fallback,
    })


def forecast_frame(df: pd.DataFrame, models: Models, h: int, spec: BacktestSpec = BacktestSpec(), *,
                   level: float = 0.8, freq: pd.Timedelta | None = None,
                   fallback: Sequence[Model] = DEFAULT_FALLBACK) -> pd.DataFrame:
    """Forecast every series of a long table ``(unique_id, ds, y)`` ``h`` buckets ahead, in this process.

    Returns a long table ``unique_id, ds, y_hat, lower, upper, p_any, model, fallback``.
    Missing buckets inside a series count as zero. For many series use
    :func:`forecasting.models.parallel.forecast_frame_parallel`.
    """
    check_long(df)
    step = freq or infer_bucket(df)
    frames = [frame_rows(uid, last, step, forecast_series(y, models, h, spec, level=level, fallback=fallback))
              for uid, (last, y) in series_arrays(df, step).items()]
    if not frames:
        return pd.DataFrame(columns=["unique_id", "ds", "y_hat", "lower", "upper", "p_any", "model", "fallback"])
    return pd.concat(frames, ignore_index=True)
