"""Trace readers: Mooncake JSONL and kvwarm logs, fast arrays, clear errors on bad rows."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forecasting.ingest.traces import (
    Trace,
    TraceError,
    from_chains,
    read_kvwarm,
    read_mooncake,
    read_trace,
    simulation_root,
)
from store.identity.keys import block_keys

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_subset_loads_as_arrays_matching_the_file() -> None:
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    trace = read_mooncake(MOONCAKE)
    assert len(trace) == len(rows) == 1409
    assert trace.block_tokens == 512 and trace.tenants == "mooncake"
    assert trace.timestamps_s.dtype == np.float64 and trace.block_ids.dtype == np.int64
    assert trace.offsets.dtype == np.int64 and len(trace.offsets) == len(rows) + 1
    assert trace.n_blocks == sum(len(r["hash_ids"]) for r in rows)
    for i in (0, 1, 700, 1408):
        assert trace.chain(i).tolist() == rows[i]["hash_ids"]
        assert trace.timestamps_s[i] == pytest.approx(rows[i]["timestamp"] / 1000)
        assert trace.input_tokens[i] == rows[i]["input_length"]
        assert trace.output_tokens[i] == rows[i]["output_length"]
    req = next(iter(trace.requests()))
    assert req.index == 0 and req.tenant == "mooncake" and req.blocks.tolist() == rows[0]["hash_ids"]


def test_block_token_counts_give_the_partial_tail_its_remainder() -> None:
    trace = from_chains([0.0, 1.0], [[1, 2, 3], [1, 4]], block_tokens=512, input_tokens=[1100, 1024])
    assert trace.block_token_counts().tolist() == [512, 512, 76, 512, 512]
    assert trace.block_depths().tolist() == [0, 1, 2, 0, 1]
    assert trace.block_request().tolist() == [0, 0, 0, 1, 1]


def test_select_keeps_chains_and_order() -> None:
    trace = read_mooncake(MOONCAKE)
    rows = np.array([3, 10, 11, 900])
    sub = trace.select(rows)
    assert len(sub) == 4 and sub.n_blocks == sum(len(trace.chain(i)) for i in rows)
    for k, i in enumerate(rows):
        assert sub.chain(k).tolist() == trace.chain(i).tolist()
    mask = trace.timestamps_s >= 300
    assert len(trace.select(mask)) == int(mask.sum())


@pytest.mark.parametrize(
    "row, field",
    [
        ({"input_length": 5, "output_length": 1, "hash_ids": [0]}, "timestamp"),
        ({"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}, "input_length"),
        ({"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [0]}, "output_length"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "0,1"}, "hash_ids"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, 1.5]}, "hash_ids"),
    ],
)
def test_malformed_mooncake_rows_name_the_line_and_field(tmp_path: Path, row: dict, field: str) -> None:
    good = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}
    path = _write_jsonl(tmp_path / "t.jsonl", [good, row])
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: field '{field}'"):
        read_mooncake(path)


def test_invalid_json_and_missing_file_are_clear(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", ['{"timestamp": 0,', "[1, 2]"])
    with pytest.raises(TraceError, match=r"t\.jsonl:1: not valid JSON"):
        read_mooncake(path)
    with pytest.raises(TraceError, match="cannot read trace"):
        read_mooncake(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        read_mooncake(_write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(ValueError, match="mooncake, kvwarm"):
        read_trace(path, "csv")


def test_kvwarm_token_ids_share_keys_by_prefix_within_a_tenant_only(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000.0, "tenant": "acme", "token_ids": list(range(10))},
        {"timestamp": 1002.5, "tenant": "acme", "token_ids": list(range(4)) + [99, 98, 97, 96]},
        {"timestamp": 1001.0, "tenant": "bolt", "token_ids": list(range(8)), "output_tokens": 7},
    ]
    trace = read_kvwarm(_write_jsonl(tmp_path / "log.jsonl", rows), block_size=4)
    # Sorted by time and shifted to start at 0.
    assert trace.timestamps_s.tolist() == [0.0, 1.0, 2.5] and trace.start_s == 1000.0
    assert list(trace.tenants) == ["acme", "bolt", "acme"]
    acme, bolt, acme2 = trace.chain(0), trace.chain(1), trace.chain(2)
    assert len(acme) == 2 and len(bolt) == 2 and len(acme2) == 2  # the partial tail of 10 tokens is unkeyed
    assert acme[0] == acme2[0] and acme[1] != acme2[1]
    assert not set(bolt.tolist()) & set(acme.tolist())
    assert trace.input_tokens.tolist() == [10, 8, 8] and trace.output_tokens.tolist() == [0, 7, 0]
    expected = block_keys(simulation_root("acme", 4), list(range(10)))
    assert [trace.key_names[b] for b in acme] == expected


def test_kvwarm_block_keys_from_parquet(tmp_path: Path) -> None:
    root = simulation_root("acme", 16)
    keys = block_keys(root, list(range(48)))
    table = pa.table({"timestamp": [5.0, 6.0], "tenant": ["acme", "acme"],
                      "block_keys": [keys, keys[:2]], "input_tokens": [50, 40]})
    pq.write_table(table, tmp_path / "log.parquet")
    trace = read_kvwarm(tmp_path / "log.parquet", block_size=16)
    assert trace.chain(0).tolist()[:2] == trace.chain(1).tolist() and len(trace.chain(0)) == 3
    assert trace.input_tokens.tolist() == [50, 40] and trace.tenants == "acme"


@pytest.mark.parametrize(
    "row, message",
    [
        ({"timestamp": 1, "tenant": "acme"}, "exactly one of 'block_keys' or 'token_ids'"),
        ({"timestamp": 1, "tenant": "", "block_keys": []}, "field 'tenant'"),
        ({"timestamp": "x", "tenant": "acme", "block_keys": []}, "field 'timestamp'"),
        ({"timestamp": 1, "tenant": "acme", "block_keys": ["zz"]}, "field 'block_keys'"),
        ({"timestamp": 1, "tenant": "acme", "token_ids": [1, -2]}, "field 'token_ids'"),
        ({"timestamp": 1, "tenant": "Bad Name", "token_ids": [1, 2]}, "field 'tenant'"),
    ],
)
def test_malformed_kvwarm_rows_name_the_line_and_field(tmp_path: Path, row: dict, message: str) -> None:
    path = _write_jsonl(tmp_path / "log.jsonl", [row])
    with pytest.raises(TraceError, match=rf"log\.jsonl:1: .*{message}"):
        read_kvwarm(path, block_size=4)


def test_kvwarm_token_ids_need_a_block_size(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "log.jsonl", [{"timestamp": 1, "tenant": "acme", "token_ids": [1, 2]}])
    with pytest.raises(TraceError, match="need a block size"):
        read_kvwarm(path)


def test_trace_checks_its_arrays() -> None:
    with pytest.raises(ValueError, match="non-decreasing"):
        from_chains([1.0, 0.0], [[1], [1]])
    z = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="offsets"):
        Trace(np.zeros(1), z, z, np.array([0, 2]), np.zeros(1, dtype=np.int64))


def _mooncake_rows(tmp_path, rows, name="t.jsonl"):  # noqa: ANN001, ANN202
    import json as _json

    p = tmp_path / name
    p.write_text("".join(_json.dumps({"timestamp": 1000 * k, "input_length": n, "output_length": 1, "hash_ids": ids})
                         + "\n" for k, (n, ids) in enumerate(rows)))
    return p


def test_a_mooncake_trace_of_32_token_blocks_is_read_at_32(tmp_path) -> None:  # noqa: ANN001
    from forecasting.ingest.traces import read_mooncake

    # 70 tokens in 3 ids, 64 in 2, 100 in 4: only blocks of 32 (of the candidates) fit all three
    p = _mooncake_rows(tmp_path, [(70, [1, 2, 3]), (64, [1, 2]), (100, [1, 2, 7, 8])])
    trace = read_mooncake(p)
    assert trace.block_tokens == 32
    assert trace.block_token_counts().tolist() == [32, 32, 6, 32, 32, 32, 32, 32, 4]
    assert read_mooncake(p, block_tokens=32).block_tokens == 32


def test_a_mooncake_trace_whose_lengths_contradict_the_block_size_is_refused(tmp_path) -> None:  # noqa: ANN001
    from forecasting.ingest.traces import TraceError, read_mooncake

    p = _mooncake_rows(tmp_path, [(70, [1, 2, 3]), (64, [1, 2]), (100, [1, 2, 7, 8])])
    with pytest.raises(TraceError, match=r"t\.jsonl:1: input_length 70 needs ceil\(70 / 512\) = 1 hash ids of 512 "
                                         r"tokens, the row has 3"):
        read_mooncake(p, block_tokens=512)
    bad = _mooncake_rows(tmp_path, [(1024, [1, 2]), (1024, [1, 2, 3, 4, 5])], "bad.jsonl")
    with pytest.raises(TraceError, match=r"no block size fits.*bad\.jsonl:2: input_length 1024 needs .* = 2 hash "
                                         r"ids of 512 tokens, the row has 5"):
        read_mooncake(bad)
    # a size no power of two fits, but every row agrees on: 48 tokens a hash id
    odd = _mooncake_rows(tmp_path, [(96, [1, 2]), (100, [1, 2, 3]), (40, [9])], "odd.jsonl")
    assert read_mooncake(odd).block_tokens == 48


def test_the_bundled_mooncake_head_is_512_tokens_a_hash_id() -> None:
    from pathlib import Path

    from forecasting.ingest.traces import read_mooncake

    head = Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_head.jsonl"
    assert read_mooncake(head).block_tokens == 512
