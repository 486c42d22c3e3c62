"""Forged store files for the fuzz test: snapshots damaged behind valid checksums, index
databases with wrong schemas or hostile rows, and files far larger than any genuine one.

:func:`forge_snapshot` writes a snapshot file around any header, laying its payload out as the
header's parts say and recomputing every checksum, so that damage to the geometry passes them
and reaches the checks behind them. :func:`geometry_consistent` is the test's own reference of
what a sound geometry is. The ``oversized_*`` and :func:`amplifying` strategies make the files of
the memory properties (192-384 KiB each, :data:`SIZES`).
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import xxhash
from hypothesis import strategies as st

from store.format.header import SnapshotHeader
from store.format.payload import META_CHECKSUM, META_HEADER, PAYLOAD_COLUMN, PAYLOAD_TYPE
from store.format.precision import STORAGE_DTYPES
from tests.store.hostile.fuzz_files import HUGE, Hostile, apply_change, value_paths, byte_mutations, dumps, values

#: the sizes of the memory properties' files: far above any genuine record, below the allowance
SIZES = st.sampled_from([192 << 10, 384 << 10])


# -- snapshots: damage that passes the checksums ----------------------------------------
def split_snapshot(raw: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A genuine snapshot file's header (as a JSON dict) and its parts' bytes by name."""
    reader = pa.ipc.open_file(pa.py_buffer(raw))
    header = json.loads(reader.schema.metadata[META_HEADER])
    col = reader.get_batch(0).column(0)
    payload = col.buffers()[2].to_pybytes()
    parts, at = {}, 0
    for p in header["parts"]:
        parts[p["name"]] = payload[at:at + p["nbytes"]]
        at += -(-p["nbytes"] // 8) * 8
    return header, parts


def forge_snapshot(header: dict[str, Any], parts: dict[str, bytes], *, max_payload: int = 8 << 20) -> bytes:
    """A snapshot file holding ``header`` whose payload is laid out as its parts say (each part's
    genuine bytes, cut or zero-padded to its ``nbytes``) with every checksum recomputed: the
    part checksums where the parts can be laid out, and always the header's."""
    header = copy.deepcopy(header)
    payload = b""
    try:
        chunks = []
        total = 0
        for p in header["parts"]:
            n = p["nbytes"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise TypeError("not a byte count")
            total += -(-n // 8) * 8
            if total > max_payload:
                raise OverflowError("too large to lay out")
            own = parts.get(p["name"], b"") if isinstance(p.get("name"), str) else b""
            data = (own + bytes(max(0, n - len(own))))[:n]
            p["xxh3"] = xxhash.xxh3_64_hexdigest(data)
            chunks.append(data + bytes(-(-n // 8) * 8 - n))
        if chunks:
            last = header["parts"][-1]["nbytes"]
            chunks[-1] = chunks[-1][:last]
        payload = b"".join(chunks)
    except (KeyError, TypeError, OverflowError, AttributeError, IndexError):
        payload = b"".join(parts.values())  # cannot be laid out: the genuine payload, as it was
    raw = dumps(header)
    schema = pa.schema([(PAYLOAD_COLUMN, PAYLOAD_TYPE)],
                       metadata={META_HEADER: raw, META_CHECKSUM: SnapshotHeader.checksum(raw).encode()})
    offsets = pa.py_buffer(np.array([0, len(payload)], dtype=np.int64))
    column = pa.Array.from_buffers(PAYLOAD_TYPE, 1, [None, offsets, pa.py_buffer(payload)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.record_batch([column], schema=schema))
    return sink.getvalue().to_pybytes()


def add_layer(header: dict[str, Any], parts: dict[str, bytes]) -> int:
    """Give a snapshot one more layer, a copy of its last, consistently (layout, parts, errors);
    returns its new layer count."""
    n = header["layout"]["num_layers"]
    for p in [p for p in header["parts"] if p["name"].endswith(f".{n - 1}")]:
        q = dict(p, name=p["name"][: -len(str(n - 1))] + str(n))
        parts[q["name"]] = parts[p["name"]]
        header["parts"].append(q)
    header["layout"]["num_layers"] = n + 1
    header["quant_error"] = {k: v + v[-1:] for k, v in header["quant_error"].items()}
    return n + 1


GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size")
small_ints = st.one_of(st.integers(-2, 40), st.sampled_from(HUGE))


@st.composite
def geometry_mutations(draw: st.DrawFn, raw: bytes) -> Hostile:
    """The genuine snapshot with its layout or its parts' shapes, byte counts, dtypes, names or
    order changed, every checksum recomputed (:func:`forge_snapshot`)."""
    header, parts = split_snapshot(raw)
    ps = header["parts"]
    i = draw(st.integers(0, len(ps) - 1))
    kind = draw(st.sampled_from(["layout", "shape", "nbytes", "shape+nbytes", "dtype", "drop", "dup", "swap",
                                 "rename", "extra_layer", "value"]))
    if kind == "layout":
        name = draw(st.sampled_from(GEOMETRY_FIELDS))
        header["layout"][name] = draw(small_ints)
        how = f"layout.{name} = {header['layout'][name]!r}"
    elif kind in ("shape", "shape+nbytes"):
        shape = draw(st.lists(small_ints, min_size=0, max_size=4))
        ps[i]["shape"] = shape
        how = f"parts[{i}].shape = {shape!r}"
        if kind == "shape+nbytes" and all(isinstance(d, int) and 0 <= d < 4096 for d in shape):
            size = STORAGE_DTYPES.get(ps[i]["dtype"], torch.uint8).itemsize
            ps[i]["nbytes"] = int(np.prod(shape, dtype=np.int64)) * size if shape else size
            how += f", nbytes = {ps[i]['nbytes']} (agreeing)"
    elif kind == "nbytes":
        ps[i]["nbytes"] = draw(st.one_of(small_ints, st.sampled_from([ps[i]["nbytes"] + 1, ps[i]["nbytes"] * 2,
                                                                      ps[i]["nbytes"] - 1, 2**40])))
        how = f"parts[{i}].nbytes = {ps[i]['nbytes']!r}"
    elif kind == "dtype":
        ps[i]["dtype"] = draw(st.sampled_from(["bf16", "fp16", "fp32", "fp8_e4m3", "int8", "", "fp64"]))
        how = f"parts[{i}].dtype = {ps[i]['dtype']!r}"
    elif kind == "drop":
        how = f"parts[{i}] ({ps.pop(i)['name']}) dropped"
    elif kind == "dup":
        ps.insert(i, copy.deepcopy(ps[i]))
        how = f"parts[{i}] ({ps[i]['name']}) twice"
    elif kind == "swap":
        j = draw(st.integers(0, len(ps) - 1))
        ps[i], ps[j] = ps[j], ps[i]
        how = f"parts[{i}] and parts[{j}] swapped"
    elif kind == "rename":
        new = draw(st.sampled_from(["k.5", "v.9", "k.-1", "k_scale.7", "k.0", "x", "", "k.00"]))
        how = f"parts[{i}] ({ps[i]['name']}) renamed {new!r}"
        ps[i]["name"] = new
    elif kind == "extra_layer":  # a self-consistent file of one more layer: wrong only beside its chain
        how = f"one more layer ({add_layer(header, parts)}), consistently"
    else:  # any header value, checksums recomputed
        path = draw(st.sampled_from([p for p in value_paths(header) if p and p[0] not in ("parts",)]))
        value = draw(values)
        header = apply_change(header, "set", path, value)
        how = f"header {'/'.join(map(str, path))} = {value!r}"[:200]
    return Hostile(f"forged ({how})", forge_snapshot(header, parts))


def snapshot_mutations(raw: bytes) -> st.SearchStrategy[Hostile]:
    return st.one_of(geometry_mutations(raw), geometry_mutations(raw), byte_mutations(raw))


def geometry_consistent(header: dict[str, Any]) -> bool:
    """Whether a header's layout agrees with its parts (a reference check, only for the test's
    oracle): K and V of each layer ``[heads, block_size, head_dim]`` with per-head fp32 scales for
    FP8 ones, each part's byte count its shape's, and no other part."""
    try:
        lay, prec = header["layout"], header["precision"]
        nl, h, bs, d = (lay[k] for k in ("num_layers", "num_kv_heads", "block_size", "head_dim"))
        if not all(type(v) is int and 0 < v < 1 << 20 for v in (nl, h, bs, d)):
            return False
        want: dict[str, tuple[str | None, list[int]]] = {}
        by_name = {p["name"]: p for p in header["parts"]}
        if len(by_name) != len(header["parts"]):
            return False
        groups = [h] if prec.get("granularity", "head") == "head" else [h, -(-bs // prec["group_tokens"])]
        for layer in range(nl):
            for kv in ("k", "v"):
                p = by_name.get(f"{kv}.{layer}")
                if p is None:
                    return False
                want[p["name"]] = (None, [h, bs, d])
                if p["dtype"] == "fp8_e4m3":
                    want[f"{kv}_scale.{layer}"] = ("fp32", groups)
        if set(by_name) != set(want):
            return False
        for name, (dtype, shape) in want.items():
            p = by_name[name]
            if p["shape"] != shape or (dtype is not None and p["dtype"] != dtype) or p["dtype"] not in STORAGE_DTYPES:
                return False
            if p["nbytes"] != int(np.prod(shape)) * STORAGE_DTYPES[p["dtype"]].itemsize:
                return False
        return True
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return False


def forged_header(data: bytes) -> dict[str, Any] | None:
    """The header dict of a file :func:`forge_snapshot` made (``None`` for other bytes)."""
    try:
        return json.loads(pa.ipc.open_file(pa.py_buffer(data)).schema.metadata[META_HEADER])
    except Exception:  # noqa: BLE001 - not a forged file
        return None


def snapshot_seeds(genuine: dict[str, bytes]) -> list[tuple[int, Hostile]]:
    """The issue's geometry attacks, every checksum recomputed: (block, file)."""
    out = []
    header, parts = split_snapshot(genuine["snapshot0"])
    header["layout"]["num_layers"] = 3
    out.append((0, Hostile("layout says 3 layers, parts hold 2", forge_snapshot(header, parts))))
    header, parts = split_snapshot(genuine["snapshot0"])
    header["parts"][0]["shape"] = [2, 16, 9]
    out.append((0, Hostile("parts[0] shape [2, 16, 9] over 512 bytes", forge_snapshot(header, parts))))
    header, parts = split_snapshot(genuine["snapshot1"])
    header["parts"][2]["nbytes"] *= 2
    out.append((1, Hostile("parts[2] twice the bytes of its shape", forge_snapshot(header, parts))))
    header, parts = split_snapshot(genuine["snapshot1"])
    n = add_layer(header, parts)
    out.append((1, Hostile(f"block 1 of {n} layers in a chain of {n - 1}", forge_snapshot(header, parts))))
    return out


# -- the index --------------------------------------------------------------------------
COLUMNS = ("name", "size", "last_access", "expires", "state", "pid")
LOOSE_TABLE = "CREATE TABLE entries (name PRIMARY KEY, size, last_access, expires, state, pid)"
REFUSING_TRIGGERS = ("CREATE TRIGGER no_update BEFORE UPDATE ON entries BEGIN SELECT RAISE(ABORT, 'hostile'); END;"
                     "CREATE TRIGGER no_delete BEFORE DELETE ON entries BEGIN SELECT RAISE(ABORT, 'hostile'); END;")
WRONG_SCHEMAS = [
    "CREATE TABLE other (x)",
    "CREATE TABLE entries (x)",
    "CREATE TABLE entries (name TEXT, size TEXT)",
    "CREATE VIEW entries AS SELECT 1 AS name, 2 AS size, 3 AS last_access, 4 AS expires, 'ready' AS state, 5 AS pid",
    "CREATE TABLE entries (name, size, last_access, expires, state, pid, extra NOT NULL)",
]
HOSTILE_CELLS = {
    "size": [-1, 2**62, 1e308, "abc", b"\x00", None, 0],
    "last_access": [1e308, -1e308, "x", None, float("inf")],
    "expires": [1e308, -1e308, "x", None, float("-inf"), 0],
    "state": ["weird", "", None, "pending", 7],
    "pid": [2**62, -1, 0, 1, "x", None, 2**31],
    "name": ["../../etc/passwd", "", "acme/zz/nothex.kvw", "x" * 5000, None, 3],
}


def sqlite_file(script: str, rows: list = ()) -> bytes:
    """The bytes of a SQLite database made by ``script``, with ``rows`` inserted into ``entries``."""
    d = Path(tempfile.mkdtemp(prefix="kvwarm-fuzz-index-"))
    try:
        db = sqlite3.connect(d / "index.sqlite")
        try:
            db.executescript(script)
            if rows:
                db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)", rows)
            db.commit()
        finally:
            db.close()
        return (d / "index.sqlite").read_bytes()
    finally:
        shutil.rmtree(d)


def genuine_rows(names: tuple[str, ...]) -> list[list[Any]]:
    now = time.time()
    return [[n, 1200, now, now + 3600, "ready", 0] for n in names]


@st.composite
def index_files(draw: st.DrawFn, raw: bytes, names: tuple[str, ...]) -> Hostile:
    """The genuine index damaged as bytes, or a real SQLite file with a wrong schema or hostile rows."""
    kind = draw(st.sampled_from(["bytes", "schema", "rows", "rows", "trigger"]))
    if kind == "bytes":
        return draw(byte_mutations(raw))
    if kind == "schema":
        ddl = draw(st.sampled_from(WRONG_SCHEMAS))
        return Hostile(f"index schema: {ddl}", sqlite_file(ddl))
    rows = genuine_rows(names)
    how = []
    for r, col in draw(st.lists(st.tuples(st.integers(0, len(rows) - 1), st.sampled_from(COLUMNS)), min_size=1,
                                max_size=4)):
        value = draw(st.sampled_from(HOSTILE_CELLS[col]))
        rows[r][COLUMNS.index(col)] = value
        how.append(f"row {r} {col} = {value!r}"[:80])
    triggers = REFUSING_TRIGGERS if kind == "trigger" else ""
    return Hostile(f"index rows: {'; '.join(how)}{'; every UPDATE and DELETE refused' if triggers else ''}",
                   sqlite_file(LOOSE_TABLE + ";" + triggers, rows))


def index_seeds(names: tuple[str, ...]) -> list[Hostile]:
    """The index cases every run tries: not a database, wrong schemas, hostile rows, refused writes."""
    rows = genuine_rows(names)
    return ([Hostile("not a database", b"not a database " * 512)]
            + [Hostile(f"index schema: {ddl}", sqlite_file(ddl)) for ddl in WRONG_SCHEMAS[1:4]]
            + [Hostile(f"index row 0 {col} = {v!r}", sqlite_file(LOOSE_TABLE, [[*r[:i], v, *r[i + 1:]] if j == 0 else r
                                                                              for j, r in enumerate(rows)]))
               for col, v in (("size", 2**62), ("pid", 2**62), ("size", 1e308), ("expires", "x"))
               for i in [COLUMNS.index(col)]]
            + [Hostile("every UPDATE and DELETE refused", sqlite_file(LOOSE_TABLE + ";" + REFUSING_TRIGGERS, rows))])


# -- files far larger than any genuine one ---------------------------------------------
def _hex_keys(n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]


@st.composite
def oversized(draw: st.DrawFn, kind: str, genuine: bytes, shape: str) -> Hostile:
    """A record of ``kind`` far larger than any genuine one (192-384 KiB), in its own shape: one
    value a long string, or its lists grown; or a small one whose values claim huge sizes and counts.

    Genuine sizes: an owner record is ~70 bytes, a plan version 16, a fleet record at most
    ``fleet_memory.max_names`` (64 here) names of ~100 bytes (and where records are capped,
    ``fleet_memory.max_file_bytes`` is its least, 64 KiB, below these files)."""
    size = draw(SIZES)
    doc = json.loads(genuine)
    if kind == "owner":
        if shape == "string":
            doc["salt_id"] = "a" * size
        elif shape == "bulk":
            doc["padding"] = list(range(1000, 1000 + size // 6))
        else:
            doc["salt_id"] = [doc.get("salt_id")] * (size // 36)
    elif kind == "plan":
        if shape == "string":
            doc["model"] = "m" * size
        else:
            doc.update(block_size=2**40, extra={"horizon_s": 1e300, "fleet_reuse": {
                "traffic_edges": [0, 2**62], "p": [1.0, 0.5], "horizon_s": 1e300}})
            for e in doc.get("entries", []):
                e.update(ttl_s=1e300, expected_hits=1e300, score=1e300, urgency=1e300)
    else:  # fleet
        n = size // 100 if shape == "bulk" else 3
        doc.update(keys=_hex_keys(n), age_s=[-1e300 if shape == "claims" else 0.5] * n,
                   uses=[10**12 if shape == "claims" else 3] * n, traffic_age=[1] * n,
                   traffic=2**62 if shape == "claims" else 10 * n)
        if shape == "claims":
            doc["written_at"] = 1e300
        if shape == "string":
            doc["node"] = "n" * size
    return Hostile(f"{kind} {shape} of about {size if shape != 'claims' else 'a few hundred'} bytes", dumps(doc))


@st.composite
def oversized_snapshots(draw: st.DrawFn, genuine: bytes, shape: str) -> Hostile:
    """A forged snapshot (checksums recomputed) whose header is 192-384 KiB (a genuine one of this
    geometry is ~1.6 KiB), or whose parts or layout claim huge sizes."""
    header, parts = split_snapshot(genuine)
    size = draw(SIZES)
    if shape == "tokens":
        header["token_ids"] = list(range(1000, 1000 + size // 5))
    elif shape == "quant_error":
        header["quant_error"] = {"k_rel_l2": [0.125] * (size // 12), "v_rel_l2": [0.125] * (size // 12)}
    elif shape == "string":
        header["model_fingerprint"] = "m" * size
    elif shape == "claims_nbytes":
        header["parts"][0]["nbytes"] = 2**40
    else:
        header["parts"][0]["shape"] = [2**20, 2**20, 2**10]
        header["layout"]["head_dim"] = 2**30
    return Hostile(f"snapshot {shape} ({size})", forge_snapshot(header, parts))


@st.composite
def amplifying(draw: st.DrawFn, kind: str) -> Hostile:
    """JSON of 192-384 KiB whose parse costs many times its size (empty containers: 2-3 bytes each
    in the file, 56-64 bytes each once parsed), at the root or in one of the record's own fields."""
    size = draw(SIZES)
    n = size // 3
    body = b"[" + b",".join([b"[]"] * n) + b"]"
    if draw(st.booleans()):
        return Hostile(f"{kind}: a list of {n} empty lists", body)
    field = {"owner": b"salt_id", "plan": b"entries", "fleet": b"keys"}[kind]
    return Hostile(f"{kind}: {field.decode()} holds {n} empty lists", b'{"' + field + b'":' + body + b"}")


@st.composite
def oversized_indexes(draw: st.DrawFn, names: tuple[str, ...], shape: str) -> Hostile:
    """A 192-384 KiB index of the tier's own schema: the chain's rows claiming huge sizes and times,
    and rows of files that do not exist, or one row whose name is the whole file."""
    size = draw(SIZES)
    path = Path(tempfile.mkdtemp(prefix="kvwarm-fuzz-index-")) / "index.sqlite"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE entries (name TEXT PRIMARY KEY, size INTEGER NOT NULL, last_access REAL NOT NULL, "
                     "expires REAL NOT NULL, state TEXT NOT NULL, pid INTEGER NOT NULL);"
                     "CREATE INDEX entries_lru ON entries(state, last_access);")
    rows = [(n, 2**62, 1e308, 1e308, "ready", 0) for n in names]
    if shape == "rows":
        rows += [(f"acme/{k[:2]}/{k}.kvw", 2**40, 0.0, 1e308, "ready", 0) for k in _hex_keys(size // 160)]
    else:
        rows.append(("acme/zz/" + "z" * size + ".kvw", 1, 0.0, 1e308, "ready", 0))
    db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()
    data = path.read_bytes()
    shutil.rmtree(path.parent)
    return Hostile(f"index {shape} ({len(rows)} rows)", data)
