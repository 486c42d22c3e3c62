"""The header's optional ``source`` field: recorded when given, absent (and ``unknown``) when not, no new version."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from store.errors import SnapshotCorrupt
from store.format.encode import build_snapshot, snapshot_bytes
from store.format.header import PREFILL, UNKNOWN_SOURCE, WRITE_BACK, SnapshotHeader
from store.format.precision import Precision
from store.format.snapshot import read_snapshot
from store.identity.keys import FORMAT_VERSION
from tests.store.factories import make_chain, make_kv, make_root, make_snapshot


def _built(source: str | None) -> SnapshotHeader:
    root = make_root()
    return build_snapshot(root=root, block=make_chain(root, 1)[0], tenant="acme", kv=make_kv(root),
                          precision=Precision(), created_at=5.0, ttl_s=60.0, source=source).header


@pytest.mark.parametrize("source", [PREFILL, WRITE_BACK])
def test_a_source_is_recorded_and_read_back(source: str) -> None:
    header = _built(source)
    assert json.loads(header.to_json())["source"] == source
    back = SnapshotHeader.from_json(header.to_json())
    assert back == header and back.source == back.origin == source


def test_without_a_source_the_header_is_what_earlier_versions_wrote_and_reads_as_unknown() -> None:
    header = _built(None)
    d = json.loads(header.to_json())
    assert "source" not in d and d["format_version"] == FORMAT_VERSION  # the same version: no key is orphaned
    back = SnapshotHeader.from_json(header.to_json())
    assert back.source is None and back.origin == UNKNOWN_SOURCE
    with_one = json.loads(_built(WRITE_BACK).to_json())
    del with_one["source"]
    assert json.dumps(with_one, sort_keys=True, separators=(",", ":")).encode() == _built(None).to_json()


def test_an_old_file_without_the_field_opens_as_before() -> None:
    root = make_root()
    snap = make_snapshot(root, make_chain(root, 1)[0])  # the factories record no source, as before the field
    opened = read_snapshot(pa.py_buffer(snapshot_bytes(snap)), full=True)
    assert opened.header.origin == UNKNOWN_SOURCE and b'"source"' not in snap.header.to_json()


def test_an_unknown_source_is_refused_when_building_and_a_non_string_one_is_corrupt_when_read() -> None:
    with pytest.raises(ValueError, match="source 'engine' is not allowed; choose one of prefill, write-back"):
        _built("engine")
    d = json.loads(_built(PREFILL).to_json())
    d["source"] = 7
    with pytest.raises(SnapshotCorrupt, match="header fields are invalid"):
        SnapshotHeader.from_json(json.dumps(d).encode())


@pytest.mark.parametrize("field, value", [
    ("expires_at", float("nan")), ("created_at", float("inf")), ("created_at", "yesterday"), ("expires_at", True),
    ("token_ids", ["1"] * 16), ("token_ids", [-1] * 16), ("token_ids", [1 << 40] * 16), ("tenant", 7),
    # one bad id among good ones: a bool, a float, below 0, above 2**32 - 1
    ("token_ids", [1] * 15 + [True]), ("token_ids", [1] * 15 + [2.0]), ("token_ids", [1] * 15 + [-1]),
    ("token_ids", [1] * 15 + [1 << 32]),
    ("quant_error", {"k_rel_l2": ["small"]}), ("quant_error", []),
])
def test_a_header_field_of_the_wrong_type_or_out_of_bounds_is_corrupt(field, value) -> None:
    d = json.loads(_built(None).to_json())
    d[field] = value
    with pytest.raises(SnapshotCorrupt, match="header fields are invalid"):
        SnapshotHeader.from_json(json.dumps(d).encode())


@pytest.mark.parametrize("where, value", [("layout", {"num_layers": True}), ("layout", {"head_dim": 0}),
                                          # counts nothing may be built from: refused before any loop over them
                                          ("layout", {"num_layers": 10**15}), ("layout", {"num_kv_heads": 10**15}),
                                          ("precision", {"group_tokens": 1.5}), ("precision", {"keep_layers": [0]})])
def test_layout_and_precision_must_be_what_the_parts_and_the_key_say(where, value) -> None:
    d = json.loads(_built(None).to_json())
    d[where].update(value)
    with pytest.raises(SnapshotCorrupt):
        SnapshotHeader.from_json(json.dumps(d).encode())
