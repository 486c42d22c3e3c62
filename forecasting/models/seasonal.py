"""Seasonal models for per-prefix demand: seasonal naive, and the median (or mean) profile over recent seasons.

What real traffic taught us (ServeGen, see docs/guides/forecasting.md): seasonal naive (daily) is
hard to beat per series; a *median* over the last days of the same hour
(:class:`SeasonalProfile`) is a robust improvement, because errors are scored by
absolute value and traffic has bursts. Both need only numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from forecasting.models.base import Fitted, _need, _Repeat, log_counts

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
        z = log_counts(y, self.log)
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
