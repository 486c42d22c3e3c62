"""Ensembles: the step-wise median (or mean) of several models' forecasts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from forecasting.models.base import FitError, Fitted, Forecast, Model


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
