"""The snapshot format: round trip, zero-copy mapping, self-description, refusals."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from store.errors import SnapshotCorrupt, SnapshotMismatch, UnknownFormatVersion
from store.format.encode import EncodedSnapshot, build_snapshot, snapshot_bytes, write_pieces, write_snapshot
from store.format.header import Layout, Part, SnapshotHeader
from store.format.payload import map_file
from store.format.precision import Precision
from store.format.snapshot import read_header, read_snapshot
from tests.store.factories import ACME, BOLT, make_chain, make_kv, make_root, make_snapshot


def _write(tmp_path: Path, snap) -> Path:
    p = tmp_path / "s.kvw"
    with open(p, "wb") as f:
        write_snapshot(f, snap)
    return p


def test_round_trip_bf16_is_exact(tmp_path: Path) -> None:
    prec = Precision(compression="bf16")
    root = make_root(precision=prec)
    block = make_chain(root, 1)[0]
    kv = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in make_kv(root, layers=3)]
    snap = build_snapshot(root=root, block=block, tenant="acme", kv=kv, precision=prec, created_at=1000.0, ttl_s=60)
    s = read_snapshot(pa.memory_map(str(_write(tmp_path, snap))), full=True)
    for i, (k, v) in enumerate(kv):
        k2, v2 = s.layer(i, torch.bfloat16)
        assert torch.equal(k2, k) and torch.equal(v2, v)
    assert s.header.quant_error["k_rel_l2"] == [0.0, 0.0, 0.0]


def test_fp8_error_is_small_and_recorded(tmp_path: Path) -> None:
    root = make_root()
    block = make_chain(root, 1)[0]
    kv = make_kv(root, layers=2, head_dim=64)
    snap = build_snapshot(root=root, block=block, tenant="acme", kv=kv, precision=Precision(), created_at=0, ttl_s=60)
    s = read_snapshot(pa.memory_map(str(_write(tmp_path, snap))))
    k0, _ = s.layer(0)
    measured = float((k0 - kv[0][0]).norm() / kv[0][0].norm())
    assert 0 < measured < 0.05
    assert s.header.quant_error["k_rel_l2"][0] == pytest.approx(measured, rel=1e-5)
    assert s.tensor("k.0").dtype == torch.float8_e4m3fn and s.tensor("k_scale.0").dtype == torch.float32


def test_mixed_precision_keeps_chosen_layers(tmp_path: Path) -> None:
    prec = Precision(keep_layers=(1,), keep_dtype="fp16")
    root = make_root(precision=prec)
    snap = make_snapshot(root, make_chain(root, 1)[0], precision=prec, layers=3)
    s = read_snapshot(pa.py_buffer(snapshot_bytes(snap)))
    assert [s.tensor(f"k.{i}").dtype for i in range(3)] == [torch.float8_e4m3fn, torch.float16, torch.float8_e4m3fn]
    assert "k_scale.1" not in {p.name for p in s.header.parts}
    assert s.header.precision.keep_layers == (1,)


def test_payload_maps_zero_copy(tmp_path: Path) -> None:
    root = make_root()
    path = _write(tmp_path, make_snapshot(root, make_chain(root, 1)[0], head_dim=64))
    mm = pa.memory_map(str(path))
    s = read_snapshot(mm)
    t = s.tensor("k.0")
    buf = s._parts["k.0"]
    assert t.data_ptr() == buf.address  # the tensor is the mapped file, not a copy
    assert not s.array("k.0").flags.writeable


def _part_bytes(s) -> dict[str, bytes]:
    return {p.name: s.array(p.name).tobytes() for p in s.header.parts}


@pytest.mark.parametrize("prec", [Precision(), Precision(keep_layers=(1,)), Precision(compression="bf16")])
def test_every_way_of_opening_gives_the_written_parts(tmp_path: Path, prec: Precision) -> None:
    # a mapped file, an in-memory buffer and a buffer Arrow must realign (shifted by one
    # byte, so the payload is a copy), verified or not: the same bytes
    root = make_root(precision=prec)
    snap = make_snapshot(root, make_chain(root, 1)[0], precision=prec, layers=3)
    data = snapshot_bytes(snap)
    want = {p.name: bytes(memoryview(b)) for p, b in zip(snap.header.parts, snap.buffers)}
    path = _write(tmp_path, snap)
    sources = [lambda: pa.memory_map(str(path)), lambda: pa.py_buffer(data),
               lambda: pa.py_buffer(b"\0" + data).slice(1)]
    for source in sources:
        for verify in (True, False):
            s = read_snapshot(source(), verify_payload=verify)
            assert _part_bytes(s) == want
            region, layout = s.payload  # one region: each part where the layout says
            for (name, _, _, nbytes), off in zip(layout.parts, layout.offsets):
                assert region[off:off + nbytes].tobytes() == want[name]
            s.close()


@pytest.mark.parametrize("source", [None, "write-back"])
def test_header_json_is_the_canonical_encoding_of_its_fields(source: str | None) -> None:
    prec = Precision(keep_layers=(1,))
    root = make_root(precision=prec)
    header = dataclasses.replace(make_snapshot(root, make_chain(root, 1)[0], precision=prec, layers=3).header,
                                 source=source)
    fields = {**dataclasses.asdict(header), "parts": [p._asdict() for p in header.parts]}  # each part an object
    if source is None:
        del fields["source"]  # optional: left out when not recorded, as files before it were written
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    assert header.to_json() == canonical
    assert SnapshotHeader.from_json(canonical) == header


def test_header_is_self_describing(tmp_path: Path) -> None:
    prec = Precision()
    root = make_root(precision=prec)
    block = make_chain(root, 2)[1]
    snap = make_snapshot(root, block, created_at=100.0, ttl_s=3600)
    h = read_header(pa.py_buffer(snapshot_bytes(snap)))
    assert (h.key, h.parent_key, h.token_ids) == (block.key, block.parent, block.tokens)
    assert h.model_fingerprint == root.model_fingerprint and h.tokenizer_fingerprint == root.tokenizer_fingerprint
    assert (h.layout.num_layers, h.layout.num_kv_heads, h.layout.head_dim, h.layout.block_size) == (2, 2, 8, 16)
    assert h.kv_dtype == "fp8_e4m3" and h.quant_scheme == prec.scheme_id()
    assert (h.created_at, h.expires_at) == (100.0, 3700.0)
    assert h.salt_id == ACME.salt_id and h.tenant == "acme"
    assert all(len(p.xxh3) == 16 for p in h.parts)


def test_reader_refuses_what_was_not_asked() -> None:
    root = make_root()
    chain = make_chain(root, 2)
    s = read_snapshot(pa.py_buffer(snapshot_bytes(make_snapshot(root, chain[0]))))
    s.header.check_matches(chain[0], root)
    with pytest.raises(SnapshotMismatch, match="key"):
        s.header.check_matches(chain[1], root)
    with pytest.raises(SnapshotMismatch):
        s.header.check_matches(chain[0], make_root(model="another-model@1"))
    with pytest.raises(SnapshotMismatch):
        s.header.check_matches(chain[0], make_root(BOLT))
    # Same key but different tokens (a hash collision): the stored ids are compared.
    forged = dataclasses.replace(chain[0], tokens=tuple(range(100, 116)))
    with pytest.raises(SnapshotMismatch, match="token ids"):
        s.header.check_matches(forged, root)


def test_unknown_format_version_is_refused() -> None:
    root = make_root()
    snap = make_snapshot(root, make_chain(root, 1)[0])
    newer = dataclasses.replace(snap.header, format_version=99)
    raw = snapshot_bytes(dataclasses.replace(snap, header=newer))
    with pytest.raises(UnknownFormatVersion, match="version 99"):
        read_snapshot(pa.py_buffer(raw))


def test_not_a_snapshot_is_corrupt(tmp_path: Path) -> None:
    p = tmp_path / "x.kvw"
    p.write_bytes(b"hello world" * 100)
    with pytest.raises(SnapshotCorrupt):
        read_snapshot(pa.memory_map(str(p)))
    header = json.loads(make_snapshot(make_root(), make_chain(make_root(), 1)[0]).header.to_json())
    header["format"] = "something-else"
    with pytest.raises(SnapshotCorrupt, match="not a kvwarm snapshot"):
        SnapshotHeader.from_json(json.dumps(header).encode())


def test_build_refuses_inconsistent_input() -> None:
    root = make_root()
    block = make_chain(root, 1)[0]
    kv = make_kv(root)
    with pytest.raises(ValueError, match="another precision"):
        build_snapshot(root=root, block=block, tenant="acme", kv=kv, precision=Precision(compression="bf16"),
                       created_at=0, ttl_s=1)
    bad = [kv[0], (kv[1][0][:, :8], kv[1][1])]
    with pytest.raises(ValueError, match="layer 1 K has shape"):
        build_snapshot(root=root, block=block, tenant="acme", kv=bad, precision=Precision(), created_at=0, ttl_s=1)



def test_a_version_1_file_is_refused_as_unknown(tmp_path: Path) -> None:
    """A file of the old layout (one column per part, version 1) is an unknown version, not corrupt."""
    root = make_root()
    snap = make_snapshot(root, make_chain(root, 1)[0])
    old = dataclasses.replace(snap.header, format_version=1)
    raw = old.to_json()
    schema = pa.schema([(p.name, pa.binary(p.nbytes)) for p in old.parts],
                       metadata={b"kvwarm.header": raw, b"kvwarm.header_xxh3": SnapshotHeader.checksum(raw).encode()})
    cols = [pa.Array.from_buffers(f.type, 1, [None, pa.py_buffer(b)]) for f, b in zip(schema, snap.buffers)]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        w.write_batch(pa.record_batch(cols, schema=schema))
    with pytest.raises(UnknownFormatVersion, match="version 1"):
        read_snapshot(sink.getvalue())


def test_a_payload_over_256_mib_round_trips(tmp_path: Path) -> None:
    """Arrow caps fixed_size_binary at 256 MiB (its width in bits is an int32): the payload
    column must not be one. 70B-class models with long blocks pass that size in bf16."""
    root = make_root()
    snap = make_snapshot(root, make_chain(root, 1)[0])
    dim = (1 << 23) + 128  # one layer, one head, 16 tokens: K and V of 128 MiB + 2 KiB each in FP8
    n = 16 * dim
    parts = tuple(Part(name, dtype, shape, nbytes, "0" * 16) for kv in ("k", "v") for name, dtype, shape, nbytes in
                  ((f"{kv}.0", "fp8_e4m3", (1, 16, dim), n), (f"{kv}_scale.0", "fp32", (1,), 4)))
    big = dataclasses.replace(snap.header, layout=Layout(1, 1, dim, 16), parts=parts)
    total = 2 * n + 8 + 4  # K, its scales (8-byte aligned), V, its scales
    enc = EncodedSnapshot(big, np.zeros(total, dtype=np.uint8))  # zero pages: nothing is allocated until read
    path = tmp_path / "big.kvw"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert write_pieces(fd, enc.pieces) == enc.file_size
    finally:
        os.close(fd)
    s = read_snapshot(map_file(path), verify_payload=False)
    region, layout = s.payload
    assert layout.nbytes == region.nbytes == total > 1 << 28
    assert s.array("k.0")[-8:].tolist() == [0] * 8


@pytest.mark.parametrize("bad", [lambda p: p.pop("xxh3"), lambda p: p.update(extra=1),
                                 lambda p: p.update(shape=7), "not an object"])
def test_a_malformed_part_in_the_header_is_corrupt(bad) -> None:
    root = make_root()
    d = json.loads(make_snapshot(root, make_chain(root, 1)[0]).header.to_json())
    if callable(bad):
        bad(d["parts"][1])
    else:
        d["parts"][1] = bad
    with pytest.raises(SnapshotCorrupt, match="header fields are invalid"):
        SnapshotHeader.from_json(json.dumps(d).encode())
