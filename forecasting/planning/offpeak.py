"""Off-peak windows: when to run the prefill job, from the total-load forecast.

Two questions, two functions:

- :func:`offpeak_windows`: the next windows where predicted load stays under a
  threshold (a fraction of the forecast peak, or of a stated capacity) for at least a
  minimum length;
- :func:`lowest_window`: the contiguous window of a given length with the lowest
  predicted load (e.g. tonight's 3 quietest hours).

The daily trough moves from day to day, so no single forecast of the load is trusted
blindly: :func:`choose_source` scores several load predictors (forecasts, and the
multi-day profile of :func:`profile_path`) by *regret* on past days - how much more
load the window each one picked actually carried than the day's true quietest window
- and the one with the lowest regret picks tonight's window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import pandas as pd

from forecasting.models.catalog import candidates
from forecasting.models.selection import forecast_series
from forecasting.models.smoothing import HoltWinters

#: a load predictor: history (1-D, oldest first) and horizon -> predicted path
Predictor = Callable[[np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class Window:
    """A stretch of buckets ``[start, end)`` and the predicted load in it."""

    start: pd.Timestamp
    end: pd.Timestamp
    mean_load: float
    max_load: float

    @property
    def length(self) -> pd.Timedelta:
        return self.end - self.start


def _as_series(load: pd.Series | pd.DataFrame, name: str = "load") -> pd.Series:
    if isinstance(load, pd.DataFrame):
        missing = {"ds", "y"} - set(load.columns)
        if missing:
            raise ValueError(f"{name}: a DataFrame needs columns 'ds' and 'y' (missing {sorted(missing)})")
        load = load.set_index("ds")["y"]
    s = load.sort_index().astype(np.float64)
    if s.empty:
        raise ValueError(f"{name}: no buckets")
    if not isinstance(s.index, pd.DatetimeIndex):
        raise ValueError(f"{name}: the index must be bucket start times (DatetimeIndex)")
    if s.index.has_duplicates:
        raise ValueError(f"{name}: duplicate bucket times")
    if not np.all(np.isfinite(s.to_numpy())):
        raise ValueError(f"{name}: NaN or infinite load values")
    return s


def _bucket(s: pd.Series, bucket: pd.Timedelta | None) -> pd.Timedelta:
    if bucket is not None:
        return bucket
    if s.size < 2:
        raise ValueError("cannot infer the bucket length from one bucket; pass bucket=")
    return _steps(s.index).min()


def _steps(index: pd.DatetimeIndex) -> pd.TimedeltaIndex:
    """Gaps between consecutive bucket starts, as Timedeltas (independent of the index's unit)."""
    return pd.TimedeltaIndex(index[1:] - index[:-1])


def offpeak_windows(load: pd.Series | pd.DataFrame, *, fraction: float = 0.6, capacity: float | None = None,
                    min_length: pd.Timedelta = pd.Timedelta(hours=2), bucket: pd.Timedelta | None = None) -> list[Window]:
    """Windows where predicted ``load`` is under ``fraction x`` (``capacity`` or the forecast peak).

    Args:
        load: predicted load per bucket, a Series indexed by bucket start or a ``(ds, y)`` table.
        fraction: the threshold as a fraction of the reference, in (0, 1].
        capacity: the reference load; the forecast's own peak when ``None``.
        min_length: windows shorter than this are dropped.
        bucket: bucket length; inferred from the index when ``None``.

    Returns:
        The windows in time order (the first is the next one).

    Raises:
        ValueError: bad load table, fraction outside (0, 1], capacity not positive.
    """
    s = _as_series(load)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if capacity is not None and not capacity > 0:
        raise ValueError(f"capacity must be a positive load, got {capacity!r}")
    step = _bucket(s, bucket)
    ref = float(s.max()) if capacity is None else float(capacity)
    under = s.to_numpy() < fraction * ref if ref > 0 else np.ones(s.size, dtype=bool)
    gaps = np.asarray(_steps(s.index) != step)  # a missing bucket breaks a window
    out: list[Window] = []
    i = 0
    while i < s.size:
        if not under[i]:
            i += 1
            continue
        j = i
        while j + 1 < s.size and under[j + 1] and not gaps[j]:
            j += 1
        start, end = s.index[i], s.index[j] + step
        if end - start >= min_length:
            vals = s.iloc[i:j + 1]
            out.append(Window(start, end, float(vals.mean()), float(vals.max())))
        i = j + 1
    return out


def lowest_window(load: pd.Series | pd.DataFrame, length: int | pd.Timedelta, *,
                  bucket: pd.Timedelta | None = None) -> Window:
    """The contiguous window of ``length`` (buckets, or a duration) with the lowest total load.

    Ties go to the earliest window.

    Raises:
        ValueError: the load is shorter than ``length`` or ``length`` is not positive.
    """
    s = _as_series(load)
    step = _bucket(s, bucket) if s.size > 1 or bucket is not None else pd.Timedelta(hours=1)
    k = int(length / step) if isinstance(length, pd.Timedelta) else int(length)
    if k < 1:
        raise ValueError(f"window length must be at least one bucket, got {length!r}")
    if k > s.size:
        raise ValueError(f"window of {k} buckets does not fit in {s.size} buckets of load")
    j = _argmin_window(s.to_numpy(), k)
    vals = s.iloc[j:j + k]
    return Window(s.index[j], s.index[j] + k * step, float(vals.mean()), float(vals.max()))


def _argmin_window(x: np.ndarray, k: int) -> int:
    sums = np.convolve(x, np.ones(k), mode="valid")
    return int(np.argmin(sums))


def profile_path(history: np.ndarray, h: int, *, period: int = 24, days: int = 7, quantile: float = 0.5) -> np.ndarray:
    """The multi-day profile: per step of the period, the ``quantile`` of the last ``days`` periods.

    A forecast that ignores today's level but not the usual shape of a day: the
    competitor of any single forecast when picking the quietest hours.
    """
    x = np.asarray(history, dtype=np.float64)
    n = min(days, x.size // period)
    if n < 1:
        raise ValueError(f"the profile needs at least one period ({period} buckets) of history, got {x.size}")
    block = x[x.size - n * period:].reshape(n, period)
    prof = np.quantile(block, quantile, axis=0)
    return np.tile(prof, -(-h // period))[:h]


#: Days in the multi-day profile (its median), and past days that score the predictors.
#: Chosen on days 5-11 of ServeGen m-large, before the bench's test days (docs/guides/forecasting.md).
PROFILE_DAYS = 14
CHOICE_DAYS = 7


def load_predictors(period: int = 24) -> dict[str, Predictor]:
    """kvwarm's predictors of total load for choosing the off-peak window.

    ``forecast``: the per-series model chosen by backtest; ``profile``: the median day of
    the last :data:`PROFILE_DAYS` (:func:`profile_path`); ``hw-log``: Holt-Winters on log
    counts. :func:`pick_window` lets their regret on past days decide.
    """
    hw = HoltWinters(period, log=True)
    return {
        "forecast": lambda x, h: forecast_series(x, lambda y: candidates(y, period), h).forecast.mean,
        "profile": lambda x, h: profile_path(x, h, period=period, days=PROFILE_DAYS),
        "hw-log": lambda x, h: hw.fit(x).forecast(h).mean,
    }


def regret(predicted: np.ndarray, actual: np.ndarray, k: int) -> float:
    """How much more load the window picked on ``predicted`` carried than the best one: ``actual/best - 1``."""
    a = np.convolve(np.asarray(actual, dtype=np.float64), np.ones(k), mode="valid")
    j = _argmin_window(np.asarray(predicted, dtype=np.float64), k)
    best = float(a.min())
    return float(a[j] / best - 1.0) if best > 0 else (0.0 if a[j] == 0 else float("inf"))


@dataclass(frozen=True)
class SourceChoice:
    """Which load predictor picks the window, and each one's mean regret on past days."""

    name: str
    regrets: dict[str, float]


def choose_source(history: np.ndarray, sources: Mapping[str, Predictor], *, length: int, period: int = 24,
                  days: int = CHOICE_DAYS, min_train: int | None = None) -> SourceChoice:
    """Score each predictor by its mean :func:`regret` over the last ``days`` periods of ``history``.

    Each past period is predicted from the history before it (rolling origin), so the
    scores are out of sample; a period needs ``min_train`` buckets before it (default two
    periods). A predictor that raises scores infinity. Ties go to the first source given.

    Raises:
        ValueError: no sources, or no past period with enough history before it.
    """
    if not sources:
        raise ValueError("choose_source needs at least one load predictor")
    x = np.asarray(history, dtype=np.float64)
    min_train = 2 * period if min_train is None else min_train
    starts = [x.size - i * period for i in range(1, days + 1) if x.size - i * period >= min_train]
    if not starts:
        raise ValueError(f"no past period with {min_train} buckets of history before it; history has {x.size}")
    regrets: dict[str, float] = {}
    for name, predict in sources.items():
        try:
            r = [regret(predict(x[:o], period), x[o:o + period], length) for o in starts]
            regrets[name] = float(np.mean(r))
        except (ValueError, ArithmeticError, np.linalg.LinAlgError):
            regrets[name] = float("inf")
    best = min(regrets, key=lambda n: (regrets[n], list(sources).index(n)))
    return SourceChoice(best, regrets)


def pick_window(history: pd.Series | pd.DataFrame, sources: Mapping[str, Predictor], *, length: int,
                period: int = 24, days: int = CHOICE_DAYS, horizon: int | None = None,
                bucket: pd.Timedelta | None = None) -> tuple[Window, SourceChoice]:
    """The quietest window of ``length`` buckets in the next ``horizon`` (default ``period``),
    on the path of the predictor with least regret over the last ``days`` periods.

    ``history`` is the total load up to now (Series by bucket start or ``(ds, y)``).
    Returns the window (with the *predicted* load in it) and the choice made.

    Raises:
        ValueError: bad history, or not one past period with two periods of history before it.
    """
    s = _as_series(history, "history")
    step = _bucket(s, bucket)
    h = period if horizon is None else horizon
    choice = choose_source(s.to_numpy(), sources, length=length, period=period, days=days)
    path = np.asarray(sources[choice.name](s.to_numpy(), h), dtype=np.float64)
    future = pd.Series(path, index=pd.DatetimeIndex([s.index[-1] + step * (i + 1) for i in range(h)]))
    return lowest_window(future, length, bucket=step), choice
