"""Intermittent-demand models: TSB (Croston with a demand probability) and a flat window mean.

Most prefixes see a request only now and then; these models need only numpy, so
thousands of sparse series fit in about a millisecond each. :class:`WindowMean` never
fails on a non-empty series and is the last fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from forecasting.models.base import Fitted, _need, _Repeat

# -- Croston / TSB -----------------------------------------------------------------------


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
