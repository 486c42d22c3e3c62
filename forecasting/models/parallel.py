"""Forecasting many series across processes.

Fits are CPU-bound Python and numpy (statsmodels holds the GIL for much of a fit), so
series are split into chunks and each chunk is forecast in a worker process. Models
are frozen dataclasses and pickle as they are. With ``workers=1`` everything runs in
this process (no pool), which is also what tests use.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence

import numpy as np
import pandas as pd

from forecasting.models.base import Model
from forecasting.models.selection import (
    DEFAULT_FALLBACK,
    BacktestSpec,
    Models,
    check_long,
    forecast_series,
    frame_rows,
    infer_bucket,
    series_arrays,
)

_COLUMNS = ["unique_id", "ds", "y_hat", "lower", "upper", "p_any", "model", "fallback"]


def _chunk_job(items: list[tuple[str, pd.Timestamp, np.ndarray]], models: Models, h: int, spec: BacktestSpec,
               level: float, freq: pd.Timedelta, fallback: Sequence[Model]) -> pd.DataFrame:
    frames = [frame_rows(uid, last, freq, forecast_series(y, models, h, spec, level=level, fallback=fallback))
              for uid, last, y in items]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=_COLUMNS)


def default_workers() -> int:
    """The CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def forecast_frame_parallel(df: pd.DataFrame, models: Models, h: int, spec: BacktestSpec = BacktestSpec(), *,
                            level: float = 0.8, freq: pd.Timedelta | None = None, workers: int | None = None,
                            chunk: int = 64, fallback: Sequence[Model] = DEFAULT_FALLBACK) -> pd.DataFrame:
    """Like :func:`forecasting.models.selection.forecast_frame`, with series spread over ``workers`` processes.

    Args:
        df: long table ``(unique_id, ds, y)``.
        models: candidate models, or a function of the series giving them
            (e.g. :func:`forecasting.models.catalog.candidates`).
        h: buckets to forecast.
        workers: processes (default: the CPUs available); 1 runs in this process.
        chunk: series per task (amortises the cost of sending work to a process).

    Returns:
        ``unique_id, ds, y_hat, lower, upper, p_any, model, fallback``, series in
        ``unique_id`` order.
    """
    check_long(df)
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of series, got {chunk!r}")
    step = freq or infer_bucket(df)
    items = [(uid, last, y) for uid, (last, y) in series_arrays(df, step).items()]
    n_workers = default_workers() if workers is None else workers
    if n_workers < 1:
        raise ValueError(f"workers must be at least 1, got {n_workers!r}")
    parts = [items[i:i + chunk] for i in range(0, len(items), chunk)]
    if n_workers == 1 or len(parts) <= 1:
        frames = [_chunk_job(p, models, h, spec, level, step, fallback) for p in parts]
    else:
        with ProcessPoolExecutor(max_workers=n_workers) as pool:
            futures = [pool.submit(_chunk_job, p, models, h, spec, level, step, fallback) for p in parts]
            frames = [f.result() for f in futures]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=_COLUMNS)
