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
"""
from __future__ import annotations

import base64
import calendar
import datetime as dt
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import fsspec
from fsspec.utils import get_protocol
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from store.tenant import check_tenant_name

#: Columns of :attr:`RequestLog.requests`, in order.
COLUMNS = ("timestamp", "tenant", "model", "prompt", "token_ids", "hash_ids", "prompt_tokens",
           "output_tokens", "cached_tokens", "latency_ms", "request_id")
PROMPT_FIELDS = ("prompt", "token_ids", "hash_ids")
COUNT_FIELDS = ("prompt_tokens", "output_tokens", "cached_tokens")
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".jsonl.gz": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
#: Why a row or file was quarantined (the ``reason`` field of a quarantine entry).
REASONS = ("invalid_json", "not_an_object", "bad_timestamp", "bad_tenant", "bad_model", "bad_prompt",
           "bad_token_ids", "bad_hash_ids", "bad_count", "bad_latency", "bad_request_id", "no_prompt",
           "unreadable_file")
_MAX_TOKEN = 2**32 - 1
_TIME_PARTITIONS = ds.HivePartitioning(pa.schema([("date", pa.string()), ("hour", pa.string())]))
_MAX_HASH = 2**63 - 1
# Times kvwarm can hold as datetime64[ns] (pandas' widest common unit).
_MIN_US, _MAX_US = 0, 9_000_000_000 * 1_000_000


class LogError(ValueError):
    """A log source cannot be used at all (missing, nothing to read, bad argument)."""


class RowError(ValueError):
    """One row is malformed; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


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


def check_row(raw: Any) -> dict[str, Any]:
    """Validate one row (a JSONL line's text or a dict) into the normalised form.

    Returns a dict with :data:`COLUMNS`; ``timestamp`` as int microseconds since the epoch.

    Raises:
        RowError: the row is malformed (the reason names the field).
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise RowError("invalid_json", str(exc)[:200]) from None
    if not isinstance(raw, dict):
        raise RowError("not_an_object", f"each row must be a JSON object, got {type(raw).__name__}")
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not _utf8(tenant):
        raise RowError("bad_tenant", f"'tenant' must be a string, got {_short(tenant)}")
    try:
        check_tenant_name(tenant)
    except ValueError as exc:
        raise RowError("bad_tenant", str(exc)) from None
    model = raw.get("model")
    if not isinstance(model, str) or not model or len(model) > 512 or not _utf8(model):
        raise RowError("bad_model", f"'model' must be a non-empty string of at most 512 characters, got {_short(model)}")
    out: dict[str, Any] = {"timestamp": _timestamp_us(raw.get("timestamp")), "tenant": tenant, "model": model}
    prompt = raw.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not _utf8(prompt)):
        raise RowError("bad_prompt", f"'prompt' must be UTF-8 text, got {_short(prompt)}")
    out["prompt"] = prompt or None
    out["token_ids"] = _int_list(raw.get("token_ids"), "token_ids", _MAX_TOKEN)
    out["hash_ids"] = _int_list(raw.get("hash_ids"), "hash_ids", _MAX_HASH)
    if all(out[f] is None for f in PROMPT_FIELDS):
        raise RowError("no_prompt", "a row needs a non-empty 'prompt', 'token_ids' or 'hash_ids'")
    for name in COUNT_FIELDS:
        value = raw.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # some writers give counts as 3.0
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                  or not 0 <= value <= _MAX_HASH):
            raise RowError("bad_count", f"'{name}' must be an integer >= 0, got {_short(value)}")
        out[name] = None if value is None else int(value)
    latency = raw.get("latency_ms")
    if latency is not None and (isinstance(latency, bool) or not isinstance(latency, (int, float, np.number))
                                or not math.isfinite(latency) or latency < 0):
        raise RowError("bad_latency", f"'latency_ms' must be a finite number >= 0, got {_short(latency)}")
    out["latency_ms"] = math.nan if latency is None else float(latency)
    rid = raw.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not _utf8(rid)):
        raise RowError("bad_request_id", f"'request_id' must be a string, got {_short(rid)}")
    out["request_id"] = rid
    return out


def _timestamp_us(value: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise RowError("bad_timestamp", f"'timestamp' is required (seconds since the epoch or ISO 8601), got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        if not math.isfinite(value):
            raise RowError("bad_timestamp", f"'timestamp' must be finite, got {value!r}")
        us = round(float(value) * 1_000_000) if isinstance(value, (float, np.floating)) else int(value) * 1_000_000
    elif isinstance(value, (str, dt.datetime)):
        try:
            when = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
        except ValueError:
            raise RowError("bad_timestamp", f"'timestamp' is not ISO 8601: {_short(value)}") from None
        if when.tzinfo is not None:
            when = when.astimezone(dt.timezone.utc).replace(tzinfo=None)
        us = calendar.timegm(when.timetuple()) * 1_000_000 + when.microsecond
    else:
        raise RowError("bad_timestamp", f"'timestamp' must be a number or an ISO 8601 string, got {_short(value)}")
    if not _MIN_US <= us < _MAX_US:
        raise RowError("bad_timestamp", f"'timestamp' {value!r} is outside 1970-01-01 .. 2255 (seconds since the epoch?)")
    return us


def _int_list(value: Any, name: str, maximum: int) -> np.ndarray | None:
    reason = f"bad_{name}"
    if value is None:
        return None
    if not isinstance(value, (list, np.ndarray)):
        raise RowError(reason, f"'{name}' must be a list of integers, got {_short(value)}")
    if len(value) == 0:
        return None
    if isinstance(value, list) and any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise RowError(reason, f"'{name}' must hold integers only")
    try:
        arr = np.asarray(value)
    except (OverflowError, ValueError):
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise RowError(reason, f"'{name}' must be integers in [0, {maximum}]")
    if int(arr.min()) < 0 or int(arr.max()) > maximum:
        raise RowError(reason, f"'{name}' must be integers in [0, {maximum}], got {int(arr.min())}..{int(arr.max())}")
    return arr.astype(np.int64)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
