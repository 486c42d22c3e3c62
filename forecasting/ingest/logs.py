"""Request logs in: JSONL or Parquet, local or ``s3://``, partitioned by time (docs/logs.md).

One row per request: ``timestamp``, ``tenant``, ``model`` and the prompt as ``prompt``
(text), ``token_ids`` or ``hash_ids`` (chained block ids, one per block); optional
``prompt_tokens``, ``output_tokens``, ``cached_tokens``, ``latency_ms``, ``request_id``.
Files are found with a pyarrow dataset over any fsspec filesystem; Hive directories
``date=YYYY-MM-DD[/hour=HH]`` let a time window skip whole files.

A malformed row never stops a run: it goes to the quarantine file (JSONL, with the
source, line or row, reason and the raw row, so nothing is lost) and is counted. The
:class:`ReadReport` says how many rows were read, used, quarantined and filtered out
by the time window: ``rows_read == rows_used + rows_quarantined + rows_filtered``.
The row schema itself (:func:`check_row`, :data:`REASONS`) lives in
:mod:`forecasting.ingest.log_row`.
"""
from __future__ import annotations

import base64
import calendar
import datetime as dt
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from fsspec.utils import get_protocol

from forecasting.ingest.log_row import COLUMNS, COUNT_FIELDS, RowError, check_row
from store.errors import BadInputError

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_TIME_PARTITIONS = ds.HivePartitioning(pa.schema([("date", pa.string()), ("hour", pa.string())]))


class LogError(BadInputError):
    """A log source cannot be used at all (missing, nothing to read, bad argument)."""


@dataclass(frozen=True)
class Quarantined:
    """One quarantined row (or unreadable file) with the raw text or row it came from."""

    source: str
    reason: str
    detail: str
    line: int | None = None
    row: int | None = None
    raw: Any = None

    def to_json(self) -> str:
        """The quarantine-file line (ASCII JSON: undecodable bytes survive as escapes)."""
        return json.dumps({"source": self.source, "line": self.line, "row": self.row, "reason": self.reason,
                           "detail": self.detail, "raw": self.raw}, default=_jsonable, ensure_ascii=True)


@dataclass(frozen=True)
class ReadReport:
    """What a read did: ``rows_read == rows_used + rows_quarantined + rows_filtered``.

    ``files_unreadable`` counts files that could not be opened or parsed at all (one
    quarantine entry each, ``reason = unreadable_file``; their rows are unknown and not
    in ``rows_read``). ``entries`` holds the quarantine entries when no quarantine file
    was given.
    """

    rows_read: int
    rows_used: int
    rows_quarantined: int
    rows_filtered: int
    files_read: int
    files_unreadable: int
    reasons: Mapping[str, int]
    quarantine_path: str | None = None
    entries: tuple[Quarantined, ...] = field(default=(), repr=False)

    def summary(self) -> str:
        """One line for logs: read, used, quarantined (by reason), filtered, files."""
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items())) or "none"
        where = f" -> {self.quarantine_path}" if self.quarantine_path else ""
        return (f"rows read {self.rows_read}, used {self.rows_used}, quarantined {self.rows_quarantined} "
                f"({why}){where}, outside window {self.rows_filtered}; files {self.files_read} read, "
                f"{self.files_unreadable} unreadable")


@dataclass(frozen=True, eq=False)
class RequestLog:
    """Valid requests (columns :data:`COLUMNS`, sorted by time) and the read's report.

    ``timestamp`` is datetime64[us], tz-naive UTC; ``token_ids``/``hash_ids`` hold int64
    numpy arrays or None; counts are nullable Int64; ``latency_ms`` float64 (NaN = absent).
    """

    requests: pd.DataFrame
    report: ReadReport


def read_logs(source: str | Path, *, fmt: str | None = None, quarantine: str | Path | None = None,
              start: Any = None, end: Any = None, storage_options: Mapping[str, Any] | None = None) -> RequestLog:
    """Read every log file under ``source`` (a file or a directory tree; local path or fsspec URL).

    Args:
        source: ``/var/log/kvwarm``, ``file:///...``, ``s3://bucket/logs`` ...
        fmt: ``jsonl`` or ``parquet``; default: by each file's extension (:data:`FORMATS`).
        quarantine: where to write malformed rows (JSONL, local path or fsspec URL);
            ``None`` keeps them in ``report.entries``.
        start, end: keep rows with ``start <= timestamp < end`` (anything
            :class:`pandas.Timestamp` takes; naive means UTC). Hive partitions
            ``date=``/``hour=`` outside the window are not opened.
        storage_options: passed to fsspec (``key``, ``secret``, ``client_kwargs`` ...).

    Raises:
        LogError: ``source`` does not exist, holds no log files, or ``fmt`` is unknown.
    """
    if fmt is not None and fmt not in ("jsonl", "parquet"):
        raise LogError(f"unknown log format {fmt!r}; use 'jsonl' or 'parquet' (or None: by extension)")
    lo, hi = window_us(start), window_us(end)
    fs, root = fsspec.core.url_to_fs(str(source), **dict(storage_options or {}))
    if not fs.exists(root):
        raise LogError(f"log source {source} does not exist")
    skip = fsspec.core.url_to_fs(str(quarantine))[1] if quarantine is not None else None
    files = [root] if fs.isfile(root) else sorted(p for p in fs.find(root) if (fmt or _format(p)) and p != skip)
    if not files:
        raise LogError(f"no log files under {source}: expected names ending in {', '.join(FORMATS)}")
    same_store = quarantine is not None and get_protocol(str(quarantine)) == get_protocol(str(source))
    sink = _Sink(quarantine, dict(storage_options or {}) if same_store else {})
    rows: list[dict[str, Any]] = []
    stats: Counter = Counter()
    try:
        for path, fragment in _fragments(fs, root, files, fmt, lo, hi):
            try:
                kind = fmt or _format(path)
                for loc, raw in _jsonl_rows(fs, path) if kind == "jsonl" else _parquet_rows(fragment):
                    stats["read"] += 1
                    try:
                        row = check_row(raw)
                    except RowError as err:
                        kept = raw if isinstance(raw, str) else _jsonable_row(raw)
                        sink.put(Quarantined(path, err.reason, err.detail, raw=kept, **loc))
                        continue
                    if (lo is not None and row["timestamp"] < lo) or (hi is not None and row["timestamp"] >= hi):
                        stats["filtered"] += 1
                    else:
                        rows.append(row)
                stats["files"] += 1
            except Exception as exc:  # noqa: BLE001 -- any failure of one file must not stop the run
                stats["unreadable"] += 1
                sink.put(Quarantined(path, "unreadable_file", f"{type(exc).__name__}: {exc}"[:500]))
    finally:
        sink.close()
    quarantined = sum(v for k, v in sink.reasons.items() if k != "unreadable_file")
    report = ReadReport(stats["read"], len(rows), quarantined, stats["filtered"], stats["files"],
                        stats["unreadable"], dict(sink.reasons), sink.path, tuple(sink.entries))
    return RequestLog(_frame(rows), report)


def _format(path: str) -> str | None:
    name = path.lower()
    return next((kind for ext, kind in FORMATS.items() if name.endswith(ext)), None)


def window_us(value: Any) -> int | None:
    """A time-window bound (ISO 8601 text, a timestamp, or ``None``) as naive-UTC microseconds.

    Raises:
        LogError: ``value`` is not a time.
    """
    if value is None:
        return None
    try:
        ts = pd.Timestamp(value)
    except (ValueError, TypeError) as exc:
        raise LogError(f"time window bound {value!r} is not a time: {exc}") from None
    if ts.tzinfo is not None:
        ts = ts.tz_convert("UTC").tz_localize(None)
    return int(ts.value // 1000)


def _fragments(fs: Any, root: str, files: list[str], fmt: str | None, lo: int | None,
               hi: int | None) -> Iterator[tuple[str, Any]]:
    """Files as pyarrow dataset fragments, skipping Hive time partitions outside [lo, hi)."""
    base = root if not fs.isfile(root) else root.rsplit("/", 1)[0]
    handler = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    for kind in ("jsonl", "parquet"):
        paths = [p for p in files if (fmt or _format(p)) == kind]
        if not paths:
            continue
        # An empty schema: building the dataset opens no file, so one bad file cannot stop the others.
        dataset = ds.dataset(paths, schema=pa.schema([]), format="json" if kind == "jsonl" else "parquet",
                             filesystem=handler, partitioning=_TIME_PARTITIONS, partition_base_dir=base)
        for frag in dataset.get_fragments():
            span = _partition_span(ds.get_partition_keys(frag.partition_expression))
            if span and ((lo is not None and span[1] <= lo) or (hi is not None and span[0] >= hi)):
                continue
            yield frag.path, frag


def _partition_span(keys: Mapping[str, Any]) -> tuple[int, int] | None:
    """The microsecond span a ``date=``/``hour=`` partition covers, or None when it names none."""
    day = keys.get("date")
    if day is None:
        return None
    try:
        start = dt.datetime.fromisoformat(str(day))
        hour = keys.get("hour")
        if hour is not None:
            start, length = start + dt.timedelta(hours=int(hour)), dt.timedelta(hours=1)
        else:
            length = dt.timedelta(days=1)
    except (ValueError, TypeError):
        return None  # not a time partition after all: read it
    us = calendar.timegm(start.timetuple()) * 1_000_000
    return us, us + int(length.total_seconds()) * 1_000_000


def _jsonl_rows(fs: Any, path: str) -> Iterator[tuple[dict[str, int], str]]:
    with fs.open(path, "rb", compression="infer") as fh:
        for lineno, line in enumerate(fh, 1):
            text = line.decode("utf-8", errors="surrogateescape").rstrip("\r\n")
            if text.strip():
                yield {"line": lineno}, text


def _parquet_rows(fragment: Any) -> Iterator[tuple[dict[str, int], dict[str, Any]]]:
    table = fragment.to_table(schema=fragment.physical_schema)
    offset = 0
    for batch in table.to_batches(max_chunksize=65536):
        columns: dict[str, list[Any]] = {}
        for name, col in zip(batch.schema.names, batch.columns):
            try:
                columns[name] = _list_column(col) if name in ("token_ids", "hash_ids") and _int_list_type(col.type) \
                    else col.to_pylist()
            except (pa.ArrowInvalid, OverflowError):  # e.g. uint64 ids past int64: check them row by row
                columns[name] = col.to_pylist()
        names = list(columns)
        for i, values in enumerate(zip(*columns.values())):
            yield {"row": offset + i}, dict(zip(names, values))
        offset += batch.num_rows


def _int_list_type(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _list_column(col: pa.Array) -> list[np.ndarray | None]:
    """An integer list column as numpy views, one per row (no Python int per element)."""
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    col = col.cast(pa.large_list(pa.int64()))
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(col))]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


def _jsonable_row(row: Any) -> Any:
    return {str(k): (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()} \
        if isinstance(row, dict) else row


class _Sink:
    """Collects quarantine entries: streamed to a JSONL file, or kept in memory."""

    def __init__(self, path: str | Path | None, storage_options: dict[str, Any]) -> None:
        self.path = None if path is None else str(path)
        self.reasons: Counter = Counter()
        self.entries: list[Quarantined] = []
        self._fh = None
        if self.path is not None:
            fs, p = fsspec.core.url_to_fs(self.path, **storage_options)
            parent = p.rsplit("/", 1)[0] if "/" in p else ""
            if parent:
                fs.makedirs(parent, exist_ok=True)
            self._fh = fs.open(p, "w", encoding="ascii")

    def put(self, entry: Quarantined) -> None:
        self.reasons[entry.reason] += 1
        if self._fh is not None:
            self._fh.write(entry.to_json() + "\n")
        else:
            self.entries.append(entry)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    cols = {name: [r[name] for r in rows] for name in COLUMNS}
    frame = pd.DataFrame({
        "timestamp": pd.to_datetime(np.asarray(cols["timestamp"], dtype=np.int64), unit="us").astype("datetime64[us]"),
        "tenant": pd.Series(cols["tenant"], dtype=object),
        "model": pd.Series(cols["model"], dtype=object),
        "prompt": pd.Series(cols["prompt"], dtype=object),
        "token_ids": pd.Series(cols["token_ids"], dtype=object),
        "hash_ids": pd.Series(cols["hash_ids"], dtype=object),
        **{name: pd.array(cols[name], dtype="Int64") for name in COUNT_FIELDS},
        "latency_ms": np.asarray(cols["latency_ms"], dtype=np.float64),
        "request_id": pd.Series(cols["request_id"], dtype=object),
    })
    return frame.sort_values("timestamp", kind="stable", ignore_index=True)
