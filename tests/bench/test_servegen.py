"""ServeGen adapter: per-client 600 s rates -> hourly counts (fixture: tests/data/servegen)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench.lib.servegen import DEFAULT_START, ServeGenError, client_files, load_servegen, read_client, to_counts

DATA = Path(__file__).resolve().parents[1] / "data" / "servegen"


def _rows(path: Path) -> list[list[str]]:
    return [line.split(",") for line in path.read_text().splitlines()]


def test_hourly_counts_are_rate_times_600_summed_per_hour() -> None:
    rows = _rows(DATA / "chunk-0-trace.csv")
    expected = np.zeros(48)
    for r in rows:
        rate = float(r[1]) if r[3] else 0.0
        expected[int(r[0]) // 3600] += rate * 600
    df = load_servegen(DATA, clients=["chunk-0"])
    assert list(df.columns) == ["unique_id", "ds", "y"]
    assert (df["unique_id"] == "chunk-0").all()
    np.testing.assert_allclose(df["y"].to_numpy(), expected)
    assert df["ds"].iloc[0] == DEFAULT_START and df["ds"].iloc[1] - df["ds"].iloc[0] == pd.Timedelta(hours=1)


def test_all_clients_share_buckets_and_idle_windows_count_zero() -> None:
    df = load_servegen(DATA)
    assert sorted(df["unique_id"].unique()) == ["chunk-0", "chunk-17", "chunk-5"]
    assert df.groupby("unique_id").size().tolist() == [48, 48, 48]
    trace = read_client(DATA / "chunk-17-trace.csv")
    idle = [int(r[0]) for r in _rows(DATA / "chunk-17-trace.csv") if not r[3]]
    assert idle and all(trace.rate[trace.window_start_s == s][0] == 0 for s in idle)


def test_ten_minute_buckets_keep_each_window() -> None:
    trace = read_client(DATA / "chunk-5-trace.csv")
    df = to_counts(trace, bucket=pd.Timedelta(minutes=10))
    np.testing.assert_allclose(df["y"].to_numpy(), trace.rate * 600)


@pytest.mark.parametrize("line, message", [
    ("0,1.0,1.0,Gamma,1", "expected 6"),
    ("0,abc,1.0,Gamma,1,1", "must be numbers"),
    ("30,1.0,1.0,Gamma,1,1", "multiple of 600"),
    ("0,-1,1.0,Gamma,1,1", ">= 0"),
    ("0,nan,1.0,Gamma,1,1", ">= 0"),
])
def test_malformed_rows_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    f = tmp_path / "chunk-3-trace.csv"
    f.write_text(f"0,0,0,,0,0\n600,0,0,,0,0\n{line.replace('0,', '1200,', 1) if line.startswith('0,') else line}\n")
    with pytest.raises(ServeGenError, match=message) as info:
        read_client(f)
    assert f"{f}:3" in str(info.value)


def test_windows_out_of_order_and_bad_folders(tmp_path: Path) -> None:
    f = tmp_path / "chunk-1-trace.csv"
    f.write_text("600,1,1,Gamma,1,1\n0,1,1,Gamma,1,1\n")
    with pytest.raises(ServeGenError, match="does not come after"):
        read_client(f)
    with pytest.raises(ServeGenError, match="does not exist"):
        client_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServeGenError, match="no chunk-N-trace.csv"):
        client_files(tmp_path / "empty")
    with pytest.raises(ServeGenError, match="no file for client"):
        load_servegen(DATA, clients=["chunk-999"])
