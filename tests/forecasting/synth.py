"""Synthetic demand series with known structure, shared by the forecasting tests."""
from __future__ import annotations

import numpy as np
import pandas as pd

START = pd.Timestamp("2025-03-03 00:00:00")


def daily_means(days: int, *, base: float = 20.0, amp: float = 15.0, trough_hour: int = 4) -> np.ndarray:
    """Hourly means of a daily cycle with its minimum at ``trough_hour``."""
    t = np.arange(days * 24)
    return base - amp * np.cos(2 * np.pi * (t - trough_hour) / 24)


def poisson(means: np.ndarray, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).poisson(means).astype(np.float64)


def intermittent(n: int, p: float, size: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < p, rng.poisson(size - 1, n) + 1, 0).astype(np.float64)


def long_table(series: dict[str, np.ndarray], start: pd.Timestamp = START) -> pd.DataFrame:
    frames = [pd.DataFrame({"unique_id": uid, "ds": start + pd.to_timedelta(np.arange(y.size), unit="h"), "y": y})
              for uid, y in series.items()]
    return pd.concat(frames, ignore_index=True)
