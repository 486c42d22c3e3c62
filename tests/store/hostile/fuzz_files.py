"""Hostile store files for the fuzz test (tests/store/hostile/test_fuzz.py).

A real template store is built once with the project's own writers (snapshots by the
encoder, the owner record by ``Store.put``, the plan by ``publish_plan``, a fleet record by
``FleetRecorder``, the index by the local tier); every example copies it, replaces one file
with hostile bytes (:func:`plant`) and runs the real readers on the copy. The strategies
start from each genuine file and damage it: raw bytes (random, truncated, bits flipped,
spliced, nested past any parser's depth), JSON values replaced by hostile ones (wrong types,
huge and negative numbers, NaN and infinities), and for snapshots geometry damage with the
checksums recomputed (:func:`forge_snapshot`), so that it passes them and reaches the checks
behind them. A :class:`Hostile` says how it was made, for a repro.
"""
from __future__ import annotations

import copy
import json
import math
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import xxhash
from hypothesis import strategies as st

from store.config import KvwarmConfig, parse_config
from store.format.encode import build_snapshot, snapshot_bytes
from store.format.header import SnapshotHeader
from store.format.payload import META_CHECKSUM, META_HEADER, PAYLOAD_COLUMN, PAYLOAD_TYPE
from store.format.precision import STORAGE_DTYPES
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.identity.tenant import Tenant
from store.plan import plan_from_prefixes, publish_plan
from store.serving.fleet import FleetRecorder
from store.tiers.base import object_name
from store.tiers.store import Store

# A strong secret (64 characters): minimum-strength rules must not refuse the fixture itself.
SECRET = "fuzz-acme-" + "5e" * 27
SECRET_ENV = "KVWARM_FUZZ_ACME_SECRET"
ACME = Tenant.derive("acme", SECRET)
MODEL = ModelIdentity(model_fingerprint="kvwarm-fuzz-model@1", tokenizer_fingerprint="fuzz-tok", name="fuzz")
BS, LAYERS, HEADS, DIM, BLOCKS = 16, 2, 2, 8, 3
STORED = list(range(100, 100 + BLOCKS * BS))
#: longer than the stored chain: a lookup also probes the public namespace (and reads its owner record)
PROMPT = STORED + list(range(300, 300 + BS + 5))
OTHER_NODE, THIS_NODE = "other-node", "this-node"
CONFIG_DOC: dict[str, Any] = {
    "kv_cache": {"block_size": BS, "compression": "fp8"},
    "tenants": {"acme": {"secret_env": SECRET_ENV}},
    # the loader under test writes no fleet record of its own; a genuine record names at most 64 blocks
    "fleet_memory": {"enabled": False, "max_names": 64},
}

#: where each file type lives under the template's local tier root
PATHS = {
    "owner": "meta/tenants/acme.json",
    "owner_public": "meta/tenants/public.json",
    "plan": "meta/plans/latest.json",
    "version": "meta/plans/latest.version",
    "fleet": f"meta/fleet/acme/{OTHER_NODE}.json",
    "fleet_public": f"meta/fleet/public/{OTHER_NODE}.json",
    "index": "meta/index.sqlite",
}


def config() -> KvwarmConfig:
    return parse_config(CONFIG_DOC)


class Template:
    """The genuine store: its directory (``nvme/`` is the local tier), its chain's object names,
    and each genuine file's bytes by type (``snapshot0``.. for the chain's blocks)."""

    def __init__(self, root: Path, names: tuple[str, ...], genuine: dict[str, bytes]) -> None:
        self.root, self.names, self.genuine = root, names, genuine

    def __repr__(self) -> str:
        return f"Template({str(self.root)!r})"

    def copy_to(self, dst: Path) -> Path:
        """A fresh copy of the store under ``dst``; returns its local tier root."""
        shutil.copytree(self.root, dst, dirs_exist_ok=True)
        return dst / "nvme"


def build_template(root: Path) -> Template:
    """Write the genuine store with the project's own writers."""
    cfg = config()
    nvme = root / "nvme"
    store = Store.open(f"file://{nvme}", cfg)
    precision = cfg.kv_cache.precision()
    key_root = MODEL.key_root(precision, BS, ACME.salt)
    g = torch.Generator().manual_seed(7)
    chain = block_chain(key_root, STORED)
    names = []
    genuine: dict[str, bytes] = {}
    for b in chain:
        kv = [(torch.randn(HEADS, BS, DIM, generator=g), torch.randn(HEADS, BS, DIM, generator=g)) for _ in range(LAYERS)]
        snap = build_snapshot(root=key_root, block=b, tenant="acme", kv=kv, precision=precision,
                              created_at=time.time(), ttl_s=7 * 24 * 3600)
        store.put(ACME, snap)
        genuine[f"snapshot{b.index}"] = snapshot_bytes(snap)
        names.append(object_name("acme", b.key))
    try:  # the plan as the pipeline publishes it (whatever its format is on this branch)
        publish_plan(plan_from_prefixes("acme", [STORED], created_at=time.time()), store.tiers)
    except Exception:  # noqa: BLE001 - a branch that publishes another way: hostile plans start from scratch
        pass
    recorder = FleetRecorder(store.tiers, OTHER_NODE)
    recorder.record(names)
    recorder.flush()
    store.close()
    for kind, rel in PATHS.items():
        if (nvme / rel).is_file():
            genuine[kind] = (nvme / rel).read_bytes()
    return Template(root, tuple(names), genuine)


def plant(nvme: Path, rel: str, data: bytes) -> Path:
    """Replace the file ``rel`` of the local tier at ``nvme`` with ``data``."""
    path = nvme / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if rel == PATHS["index"]:
        for extra in ("-wal", "-shm"):
            Path(f"{path}{extra}").unlink(missing_ok=True)
    path.write_bytes(data)
    return path


@dataclass(frozen=True)
class Hostile:
    """Hostile bytes and how they were made (what a failing example prints)."""

    how: str
    data: bytes

    def __repr__(self) -> str:
        head = self.data[:160]
        return f"Hostile(how={self.how!r}, size={len(self.data)}, head={head!r})"


# -- hostile JSON values ----------------------------------------------------------
HUGE = [2**31, 2**53 + 1, 2**63, 2**64 + 7, 10**30, -1, -(2**63) - 1, 0, 10**12]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 1e300, -1e300, 5e-324, -0.0]
scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(HUGE), st.integers(-1000, 1000),
    st.sampled_from(SPECIAL_FLOATS), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "0", "1e9", "NaN", "../../etc/passwd", "acme", "public", "a" * 300, "\x00", "\ud800"]),
    st.text(max_size=12),
)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                      max_leaves=10)


def dumps(doc: Any) -> bytes:
    """JSON as a careless writer makes it: NaN and infinities as bare words, lone surrogates escaped."""
    return json.dumps(doc, allow_nan=True, sort_keys=True, separators=(",", ":")).encode()


def _paths(doc: Any, at: tuple = (), depth: int = 0) -> list[tuple]:
    """Every value's path in ``doc`` (lists: their first three items only)."""
    out = [at]
    if depth > 6:
        return out
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, at + (k,), depth + 1)
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += _paths(v, at + (i,), depth + 1)
    return out


def _apply(doc: Any, op: str, path: tuple, value: Any) -> Any:
    """``doc`` with one change at ``path``: ``set`` it, ``del`` it, ``add`` a key or item, ``grow`` a list."""
    if not path:
        return value if op in ("set", "add") else doc
    doc = copy.deepcopy(doc)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "set":
        parent[last] = value
    elif op == "del":
        del parent[last]
    elif op == "add":
        target = parent[last]
        if isinstance(target, dict):
            target["x-hostile"] = value
        elif isinstance(target, list):
            target.append(value)
        else:
            parent[last] = [target, value]
    elif op == "grow":
        target = parent[last]
        parent[last] = (target * 4 + [value]) if isinstance(target, list) else value
    return doc


@st.composite
def json_mutations(draw: st.DrawFn, raw: bytes) -> Hostile:
    """The genuine JSON document ``raw`` with one to three values replaced, removed, added or grown."""
    doc = json.loads(raw)
    how = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        op = draw(st.sampled_from(["set", "set", "set", "del", "add", "grow"]))
        value = draw(values)
        try:
            doc = _apply(doc, op, path, value)
        except (KeyError, IndexError, TypeError):
            continue
        how.append(f"{op} {'/'.join(map(str, path)) or '<root>'} = {value!r}"[:200])
    return Hostile("json: " + "; ".join(how), dumps(doc))


@st.composite
def byte_mutations(draw: st.DrawFn, raw: bytes) -> Hostile:
    """``raw`` damaged as bytes: replaced, emptied, truncated, bits flipped, spliced, or nested past a parser's depth."""
    kind = draw(st.sampled_from(["random", "empty", "truncate", "flip", "splice", "nest", "bigint", "utf8"]))
    if kind == "random":
        return Hostile("random bytes", draw(st.binary(max_size=512)))
    if kind == "empty":
        return Hostile("empty", b"")
    if kind == "truncate":
        n = draw(st.integers(0, max(0, len(raw) - 1)))
        return Hostile(f"truncated to {n}", raw[:n])
    if kind == "flip":
        data = bytearray(raw)
        flips = draw(st.lists(st.tuples(st.integers(0, max(0, len(raw) - 1)), st.integers(0, 7)), min_size=1, max_size=4))
        for i, bit in flips:
            if data:
                data[i] ^= 1 << bit
        return Hostile(f"bits flipped at {flips}", bytes(data))
    if kind == "splice":
        at = draw(st.integers(0, len(raw)))
        junk = draw(st.binary(min_size=1, max_size=64))
        return Hostile(f"{junk!r} spliced at {at}", raw[:at] + junk + raw[at:])
    if kind == "nest":
        n = draw(st.sampled_from([2000, 100_000]))
        return Hostile(f"nested {n} deep", b"[" * n + b"]" * n)
    if kind == "bigint":  # past Python's 4300-digit limit: json raises a plain ValueError
        return Hostile("a 5000-digit number", b'{"salt_id":' + b"1" * 5000 + b"}")
    return Hostile("not UTF-8", b"\xff\xfe" + raw[: len(raw) // 2] + b"\xc3\x28")


def record_mutations(raw: bytes | None) -> st.SearchStrategy[Hostile]:
    """Hostile versions of a genuine JSON record (or of a small object when there is none)."""
    base = raw if raw is not None else b'{"kvwarm_plan":2,"entries":[]}'
    return st.one_of(json_mutations(base), byte_mutations(base))


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
        n = header["layout"]["num_layers"]
        for p in [p for p in ps if p["name"].endswith(f".{n - 1}")]:
            q = copy.deepcopy(p)
            q["name"] = p["name"][: -len(str(n - 1))] + str(n)
            parts[q["name"]] = parts[p["name"]]
            ps.append(q)
        header["layout"]["num_layers"] = n + 1
        header["quant_error"] = {k: v + v[-1:] for k, v in header["quant_error"].items()}
        how = f"one more layer ({n + 1}), consistently"
    else:  # any header value, checksums recomputed
        path = draw(st.sampled_from([p for p in _paths(header) if p and p[0] not in ("parts",)]))
        value = draw(values)
        header = _apply(header, "set", path, value)
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


# -- the index --------------------------------------------------------------------------
HOSTILE_CELLS = {
    "size": [-1, 2**62, 1e308, "abc", b"\x00", None, 0],
    "last_access": [1e308, -1e308, "x", None, float("inf")],
    "expires": [1e308, -1e308, "x", None, float("-inf"), 0],
    "state": ["weird", "", None, "pending", 7],
    "pid": [2**62, -1, 0, 1, "x", None, 2**31],
    "name": ["../../etc/passwd", "", "acme/zz/nothex.kvw", "x" * 5000, None, 3],
}


@st.composite
def index_files(draw: st.DrawFn, raw: bytes, names: tuple[str, ...]) -> Hostile:
    """The genuine index damaged as bytes, or a real SQLite file with a wrong schema or hostile rows."""
    kind = draw(st.sampled_from(["bytes", "schema", "rows", "rows", "trigger"]))
    if kind == "bytes":
        return draw(byte_mutations(raw))
    path = Path(f"/dev/shm/kvwarm-fuzz-index-{id(raw)}-{time.monotonic_ns()}.sqlite")
    if not Path("/dev/shm").is_dir():
        path = Path(f"/tmp/kvwarm-fuzz-index-{time.monotonic_ns()}.sqlite")
    db = sqlite3.connect(path)
    try:
        if kind == "schema":
            ddl = draw(st.sampled_from([
                "CREATE TABLE other (x)",
                "CREATE TABLE entries (x)",
                "CREATE TABLE entries (name TEXT, size TEXT)",
                "CREATE VIEW entries AS SELECT 1 AS name, 2 AS size, 3 AS last_access, 4 AS expires, 'ready' AS state, 5 AS pid",
                "CREATE TABLE entries (name, size, last_access, expires, state, pid, extra NOT NULL)",
            ]))
            db.executescript(ddl)
            how = f"schema: {ddl}"
        else:
            db.executescript("CREATE TABLE entries (name PRIMARY KEY, size, last_access, expires, state, pid)")
            now = time.time()
            rows = [[n, 1200, now, now + 3600, "ready", 0] for n in names]
            cols = list(HOSTILE_CELLS)
            changes = draw(st.lists(st.tuples(st.integers(0, len(rows) - 1), st.sampled_from(cols)), min_size=1,
                                    max_size=4))
            how_parts = []
            for r, col in changes:
                value = draw(st.sampled_from(HOSTILE_CELLS[col]))
                rows[r][["name", "size", "last_access", "expires", "state", "pid"].index(col)] = value
                how_parts.append(f"row {r} {col} = {value!r}"[:80])
            db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)", rows)
            how = "rows: " + "; ".join(how_parts)
            if kind == "trigger":
                db.executescript("CREATE TRIGGER no_update BEFORE UPDATE ON entries BEGIN SELECT RAISE(ABORT, 'hostile'); END;"
                                 "CREATE TRIGGER no_delete BEFORE DELETE ON entries BEGIN SELECT RAISE(ABORT, 'hostile'); END;")
                how += "; triggers refuse every UPDATE and DELETE"
        db.commit()
    finally:
        db.close()
    data = path.read_bytes()
    path.unlink()
    return Hostile(f"index {how}", data)
