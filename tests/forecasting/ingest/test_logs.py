"""Request-log readers: schema, quarantine, time partitions, S3, and malformed input that never crashes them."""
from __future__ import annotations

import gzip
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forecasting.ingest.log_row import COLUMNS, REASONS, RowError, check_row
from forecasting.ingest.logs import LogError, read_logs
from tests.forecasting.logs_factory import (
    MODEL,
    START,
    parquet_bad_rows,
    row_time,
    standard_log,
    write_jsonl,
    write_parquet,
)


def _quarantine(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="ascii").splitlines()]


def test_jsonl_log_every_row_accounted_for(tmp_path: Path) -> None:
    log = standard_log()
    write_jsonl(log, tmp_path / "logs")
    out = read_logs(tmp_path / "logs", quarantine=tmp_path / "q" / "bad.jsonl")
    rep = out.report
    assert rep.rows_read == len(log.rows) + len(log.bad)
    assert rep.rows_read == rep.rows_used + rep.rows_quarantined and rep.rows_filtered == 0
    assert rep.rows_used == len(log.rows) and rep.files_read == log.days and rep.files_unreadable == 0
    assert dict(rep.reasons) == dict(Counter(reason for _, reason in log.bad))
    assert list(out.requests.columns) == list(COLUMNS)
    assert list(out.requests["request_id"]) == [r["request_id"] for r in log.rows]
    entries = _quarantine(tmp_path / "q" / "bad.jsonl")
    assert len(entries) == rep.rows_quarantined
    # Nothing is lost: each entry carries the raw line exactly as it was written.
    written = [raw if isinstance(raw, str) else json.dumps(raw) for raw, _ in log.bad]
    assert [e["raw"] for e in entries] == written
    assert [e["reason"] for e in entries] == [reason for _, reason in log.bad]
    assert all(e["line"] >= 1 and e["source"].endswith(".jsonl") and e["detail"] for e in entries)


def test_a_quarantine_file_inside_the_log_tree_is_not_read_back(tmp_path: Path) -> None:
    log = standard_log()
    write_jsonl(log, tmp_path)
    first = read_logs(tmp_path, quarantine=tmp_path / "quarantine.jsonl").report
    second = read_logs(tmp_path, quarantine=tmp_path / "quarantine.jsonl").report
    assert first == second and second.rows_quarantined == len(log.bad)


def test_parquet_log_every_row_accounted_for(tmp_path: Path) -> None:
    log = standard_log()
    write_parquet(log, tmp_path / "logs")
    out = read_logs(tmp_path / "logs", quarantine=tmp_path / "bad.jsonl")
    rep = out.report
    bad = parquet_bad_rows()
    assert (rep.rows_read, rep.rows_used, rep.rows_quarantined) == (len(log.rows) + len(bad), len(log.rows), len(bad))
    assert dict(rep.reasons) == dict(Counter(reason for _, reason in bad))
    entries = _quarantine(tmp_path / "bad.jsonl")
    assert [e["row"] for e in entries] == [3 * i + 1 for i in range(len(bad))]
    assert entries[3]["raw"]["tenant"] == "Bad Name"


def test_jsonl_and_parquet_give_the_same_requests(tmp_path: Path) -> None:
    log = standard_log()
    write_jsonl(log, tmp_path / "j", bad=False)
    write_parquet(log, tmp_path / "p", bad=False)
    a, b = read_logs(tmp_path / "j").requests, read_logs(tmp_path / "p").requests
    pd.testing.assert_series_equal(a["timestamp"], b["timestamp"])
    assert list(a["tenant"]) == list(b["tenant"]) and list(a["prompt"]) == list(b["prompt"])
    for x, y in zip(a["token_ids"], b["token_ids"]):
        assert (x is None and y is None) or np.array_equal(x, y)
    assert a["timestamp"].dtype == "datetime64[us]" and a["timestamp"].min() >= START


def test_time_window_skips_partitions_and_filters_rows(tmp_path: Path) -> None:
    log = standard_log()
    write_jsonl(log, tmp_path / "logs")
    day2 = START + pd.Timedelta(days=1)
    late = read_logs(tmp_path / "logs", start=day2)
    n_day2 = sum(1 for r in log.rows if row_time(r["timestamp"]) >= day2)
    # The first day's partition is never opened: its rows (and its bad rows) are not even read.
    assert late.report.files_read == 1 and late.report.rows_read == late.report.rows_used == n_day2
    noon = START + pd.Timedelta(hours=12)
    part = read_logs(tmp_path / "logs", start=noon, end=day2)
    rep = part.report
    assert rep.files_read == 1 and rep.rows_read == rep.rows_used + rep.rows_quarantined + rep.rows_filtered
    assert part.requests["timestamp"].between(noon, day2, inclusive="left").all() and rep.rows_filtered > 0


def test_unreadable_files_are_quarantined_and_the_run_goes_on(tmp_path: Path) -> None:
    log = standard_log()
    write_jsonl(log, tmp_path / "logs", bad=False)
    (tmp_path / "logs" / "garbage.parquet").write_bytes(b"PAR1 this is not parquet")
    with gzip.open(tmp_path / "logs" / "cut.jsonl.gz", "wb") as fh:
        fh.write(json.dumps(log.rows[0]).encode() + b"\n" + json.dumps(log.rows[1]).encode() + b"\n")
    data = (tmp_path / "logs" / "cut.jsonl.gz").read_bytes()
    (tmp_path / "logs" / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    out = read_logs(tmp_path / "logs")
    rep = out.report
    assert rep.files_unreadable == 2 and rep.reasons["unreadable_file"] == 2
    assert rep.rows_used >= len(log.rows) and rep.rows_read == rep.rows_used + rep.rows_quarantined
    assert {Path(e.source).name for e in rep.entries} == {"garbage.parquet", "cut.jsonl.gz"}


def test_undecodable_bytes_survive_in_quarantine(tmp_path: Path) -> None:
    line = b'{"timestamp": 1, "tenant": "acme", "model": "m", "prompt": "caf\xe9 \xff"}'
    (tmp_path / "a.jsonl").write_bytes(line + b"\n")
    out = read_logs(tmp_path / "a.jsonl", quarantine=tmp_path / "q.jsonl")
    assert out.report.reasons == {"bad_prompt": 1}
    raw = _quarantine(tmp_path / "q.jsonl")[0]["raw"]
    assert raw.encode("utf-8", errors="surrogateescape") == line


def test_check_row_normalises_times_and_lists() -> None:
    row = check_row({"timestamp": "2026-03-02T01:00:00+01:00", "tenant": "acme", "model": "m",
                     "token_ids": np.array([1, 2], dtype=np.int32), "latency_ms": 3, "cached_tokens": 0})
    assert row["timestamp"] == int(pd.Timestamp("2026-03-02T00:00:00").value // 1000)
    assert row["token_ids"].dtype == np.int64 and row["latency_ms"] == 3.0 and row["prompt"] is None
    assert check_row('{"timestamp": 1.5, "tenant": "a", "model": "m", "hash_ids": [7]}')["timestamp"] == 1_500_000
    for bad, reason in [({"timestamp": True}, "bad_timestamp"), ({"output_tokens": True}, "bad_count"),
                        ({"token_ids": [2**40]}, "bad_token_ids"), ({"hash_ids": [[1]]}, "bad_hash_ids"),
                        ({"request_id": 5}, "bad_request_id"), ({"timestamp": 1e300}, "bad_timestamp")]:
        with pytest.raises(RowError) as err:
            check_row({"timestamp": 1, "tenant": "a", "model": "m", "prompt": "x", **bad})
        assert err.value.reason == reason and err.value.reason in REASONS


def test_bad_sources_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(LogError, match="does not exist"):
        read_logs(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(LogError, match="no log files"):
        read_logs(tmp_path)
    with pytest.raises(LogError, match="unknown log format"):
        read_logs(tmp_path, fmt="csv")


@pytest.mark.s3
def test_reads_partitioned_logs_from_s3(tmp_path: Path, raw_s3, seaweed, s3_url: str) -> None:
    log = standard_log()
    write_parquet(log, tmp_path / "p")
    bucket = s3_url[5:].split("/", 1)[0]
    if not raw_s3.exists(bucket):
        raw_s3.mkdir(bucket)
    for f in (tmp_path / "p").rglob("*.parquet"):
        raw_s3.put(str(f), f"{s3_url[5:]}/{f.relative_to(tmp_path / 'p')}")
    opts = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": seaweed.endpoint},
            "skip_instance_cache": True}
    out = read_logs(s3_url, storage_options=opts, start=START + pd.Timedelta(days=1))
    local = read_logs(tmp_path / "p", start=START + pd.Timedelta(days=1))
    assert out.report.files_read == 1 and out.report.rows_used == local.report.rows_used > 0
    assert list(out.requests["request_id"]) == list(local.requests["request_id"])


# --- malformed input never crashes the readers -------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
_fields = st.sampled_from(["timestamp", "tenant", "model", "prompt", "token_ids", "hash_ids", "output_tokens",
                           "latency_ms", "request_id", "cached_tokens", "prompt_tokens"])
_near_rows = st.dictionaries(_fields, _json_values | st.sampled_from(
    [1780000000, "2026-03-02T00:00:00Z", "acme", MODEL, [1, 2, 3], "hello"]), max_size=8)
_lines = st.one_of(st.binary(max_size=60), _near_rows.map(lambda d: json.dumps(d).encode()),
                   _json_values.map(lambda v: json.dumps(v).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_lines, max_size=12))
def test_jsonl_reader_never_crashes(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.jsonl"
        path.write_bytes(b"\n".join(lines))
        rep = read_logs(path, quarantine=Path(tmp) / "q.jsonl").report
        assert rep.rows_read == rep.rows_used + rep.rows_quarantined
        assert rep.files_unreadable == 0
        assert sum(1 for _ in (Path(tmp) / "q.jsonl").open()) == rep.rows_quarantined


_arrow_columns = st.sampled_from([
    ("timestamp", pa.float64(), st.floats() | st.none()),
    ("timestamp", pa.string(), st.text(max_size=25) | st.none()),
    ("timestamp", pa.int64(), st.integers(-2**63, 2**63 - 1) | st.none()),
    ("tenant", pa.string(), st.sampled_from(["acme", "Bad", ""]) | st.text(max_size=5) | st.none()),
    ("tenant", pa.int32(), st.integers(-5, 5) | st.none()),
    ("model", pa.string(), st.text(max_size=5) | st.none()),
    ("prompt", pa.string(), st.text(max_size=10) | st.none()),
    ("prompt", pa.binary(), st.binary(max_size=10) | st.none()),
    ("token_ids", pa.list_(pa.int64()), st.lists(st.integers(-2**63, 2**63 - 1), max_size=5) | st.none()),
    ("token_ids", pa.list_(pa.uint64()), st.lists(st.integers(0, 2**64 - 1), max_size=5) | st.none()),
    ("token_ids", pa.list_(pa.float32()), st.lists(st.floats(width=32), max_size=5) | st.none()),
    ("hash_ids", pa.list_(pa.int8()), st.lists(st.integers(-128, 127), max_size=5) | st.none()),
    ("output_tokens", pa.float64(), st.floats() | st.none()),
    ("latency_ms", pa.string(), st.text(max_size=5) | st.none()),
])


@st.composite
def _parquet_tables(draw) -> pa.Table:
    n = draw(st.integers(0, 6))
    cols = {}
    for name, typ, values in draw(st.lists(_arrow_columns, max_size=7, unique_by=lambda c: c[0])):
        cols[name] = pa.array([draw(values) for _ in range(n)], type=typ)
    return pa.table(cols) if cols else pa.table({"x": pa.array([0] * n)})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=_parquet_tables(), junk=st.binary(max_size=40))
def test_parquet_reader_never_crashes(table: pa.Table, junk: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(table, Path(tmp) / "a.parquet")
        (Path(tmp) / "b.parquet").write_bytes(junk)
        rep = read_logs(tmp).report
        assert rep.rows_read == table.num_rows == rep.rows_used + rep.rows_quarantined
        assert rep.files_unreadable == 1 and rep.files_read == 1
