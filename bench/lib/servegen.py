"""Adapter for ServeGen per-client rate traces (alibaba/ServeGen, ``data/language/*``).

A ServeGen trace is one CSV file per client, ``chunk-N-trace.csv``, one row per
600 s window and no header::

    window_start_s, rate_req_per_s, cv, arrival_dist, param1, param2

Time 0 is local midnight of the first day. An empty ``arrival_dist`` means the client
sent nothing in that window. Forecasting wants demand as a long table
``(unique_id, ds, y)``; here ``unique_id`` is the client (``chunk-N``), ``ds`` the
bucket start (tz-naive, counted from ``start``) and ``y`` the expected request count
in the bucket: ``rate x 600`` summed over the windows the bucket holds. Each client
stands for one prefix family when the trace drives the forecasting benchmark.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from store.errors import BadInputError

#: length of one ServeGen window
WINDOW_S = 600
#: a fixed, arbitrary calendar origin for time 0 (the trace gives no date)
DEFAULT_START = pd.Timestamp("2025-01-06 00:00:00")  # a Monday

_NAME = re.compile(r"^chunk-(\d+)-trace\.csv$")


class ServeGenError(BadInputError):
    """A ServeGen file is missing or malformed. The message names the file and the line."""


@dataclass(frozen=True)
class ClientTrace:
    """One client's windows: start second and request rate, in file order."""

    client: str
    window_start_s: np.ndarray  # int64, seconds from local midnight of day 1
    rate: np.ndarray  # float64 requests per second (0 where the client was idle)


def client_name(path: str | Path) -> str:
    """``chunk-17-trace.csv`` -> ``chunk-17``."""
    m = _NAME.match(Path(path).name)
    if not m:
        raise ServeGenError(f"{str(path)!r} is not a ServeGen client file (expected chunk-N-trace.csv)")
    return f"chunk-{m.group(1)}"


def read_client(path: str | Path) -> ClientTrace:
    """Read one ``chunk-N-trace.csv``.

    Raises:
        ServeGenError: the file is unreadable, a row has the wrong number of fields, a
            number does not parse or is negative/non-finite, a window does not start on a
            600 s boundary, windows repeat or go backwards, or a row with traffic has no
            distribution name. The message gives the file and the 1-based line number.
    """
    p = Path(path)
    name = client_name(p)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ServeGenError(f"{p}: cannot read the ServeGen file: {exc}") from None
    starts: list[int] = []
    rates: list[float] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split(",")
        where = f"{p}:{lineno}"
        if len(fields) != 6:
            raise ServeGenError(f"{where}: expected 6 comma-separated fields "
                                f"(window_start_s, rate, cv, arrival_dist, param1, param2), got {len(fields)}")
        try:
            start_f = float(fields[0])
            rate = float(fields[1])
        except ValueError:
            raise ServeGenError(f"{where}: window_start_s and rate must be numbers, got {fields[0]!r}, {fields[1]!r}") from None
        if not math.isfinite(start_f) or start_f < 0 or start_f % WINDOW_S:
            raise ServeGenError(f"{where}: window_start_s {fields[0]!r} is not a non-negative multiple of {WINDOW_S}")
        if not math.isfinite(rate) or rate < 0:
            raise ServeGenError(f"{where}: rate {fields[1]!r} must be a finite number >= 0")
        dist = fields[3].strip()
        if not dist:
            rate = 0.0  # NOTE: an empty distribution means no traffic, whatever the rate column says
        start = int(start_f)
        if starts and start <= starts[-1]:
            raise ServeGenError(f"{where}: window {start} s does not come after the previous one ({starts[-1]} s)")
        starts.append(start)
        rates.append(rate)
    if not starts:
        raise ServeGenError(f"{p}: the file holds no windows")
    return ClientTrace(name, np.asarray(starts, dtype=np.int64), np.asarray(rates, dtype=np.float64))


def client_files(directory: str | Path) -> list[Path]:
    """The ``chunk-N-trace.csv`` files of a trace folder, by client number."""
    d = Path(directory)
    if not d.is_dir():
        raise ServeGenError(f"ServeGen folder {str(d)!r} does not exist; pass the folder holding chunk-N-trace.csv")
    files = [f for f in d.iterdir() if _NAME.match(f.name)]
    if not files:
        raise ServeGenError(f"ServeGen folder {str(d)!r} holds no chunk-N-trace.csv files")
    return sorted(files, key=lambda f: int(_NAME.match(f.name).group(1)))  # type: ignore[union-attr]


def to_counts(trace: ClientTrace, *, bucket: pd.Timedelta = pd.Timedelta(hours=1),
              start: pd.Timestamp = DEFAULT_START, n_buckets: int | None = None) -> pd.DataFrame:
    """One client's expected counts per bucket as a long table ``(unique_id, ds, y)``.

    Windows missing from the file count as no traffic. ``bucket`` must be a whole
    multiple of 600 s. ``n_buckets`` pads (with zeros) or cuts the series to a length.
    """
    step = int(bucket.total_seconds())
    if step <= 0 or step % WINDOW_S:
        raise ServeGenError(f"bucket {bucket} must be a positive multiple of {WINDOW_S} s")
    idx = trace.window_start_s // step
    n = int(idx.max()) + 1 if n_buckets is None else n_buckets
    keep = idx < n
    y = np.bincount(idx[keep], weights=trace.rate[keep] * WINDOW_S, minlength=n)[:n]
    ds = start + pd.to_timedelta(np.arange(n) * step, unit="s")
    return pd.DataFrame({"unique_id": trace.client, "ds": ds, "y": y.astype(np.float64)})


def load_servegen(directory: str | Path, *, bucket: pd.Timedelta = pd.Timedelta(hours=1),
                  start: pd.Timestamp = DEFAULT_START, clients: Iterable[str] | None = None) -> pd.DataFrame:
    """Every client of a ServeGen folder as one long table ``(unique_id, ds, y)``.

    All clients get the same buckets (up to the latest window of any client), so a
    client that stops early has explicit zero buckets. ``clients`` limits the read to
    some ``chunk-N`` names.

    Raises:
        ServeGenError: the folder or a file is missing or malformed, or a named client
            has no file.
    """
    files = client_files(directory)
    if clients is not None:
        wanted = set(clients)
        have = {client_name(f) for f in files}
        missing = wanted - have
        if missing:
            raise ServeGenError(f"no file for client(s) {sorted(missing)} in {str(directory)!r}")
        files = [f for f in files if client_name(f) in wanted]
    traces = [read_client(f) for f in files]
    step = int(bucket.total_seconds())
    n = max(int(t.window_start_s.max()) // max(step, 1) for t in traces) + 1
    frames = [to_counts(t, bucket=bucket, start=start, n_buckets=n) for t in traces]
    return pd.concat(frames, ignore_index=True)
