"""The shared face of every forecasting model: :class:`Forecast`, :class:`Fitted`, :class:`Model`.

A model is a frozen dataclass (the specification) whose ``fit(y)`` returns a
:class:`Fitted`; ``Fitted.forecast(h)`` gives a :class:`Forecast`. The models themselves
live in :mod:`forecasting.models.catalog` (seasonal, Holt-Winters, STL), :mod:`forecasting.models.intermittent`
(TSB, window mean) and :mod:`forecasting.models.ensemble`; this module holds what they share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from store.errors import BadInputError

#: z-scores of the central interval levels used most; others via the normal quantile
_Z = {0.5: 0.6745, 0.8: 1.2816, 0.9: 1.6449, 0.95: 1.9600}


class FitError(BadInputError):
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


def log_counts(y: np.ndarray, log: bool) -> np.ndarray:
    """``log1p(y)`` when ``log``, else ``y``: the scale a model that fits log counts works on."""
    return np.log1p(y) if log else y


def _need(y: np.ndarray, n: int, what: str) -> None:
    if y.size < n:
        raise FitError(f"{what} needs at least {n} points of history, got {y.size}")


# -- repeating a season (seasonal naive, profile, window mean) -----------------------------


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
