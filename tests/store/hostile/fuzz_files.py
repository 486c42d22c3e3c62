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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from hypothesis import strategies as st

from store.config import KvwarmConfig, parse_config
from store.config_sections import FleetMemoryConfig
from store.format.encode import build_snapshot, snapshot_bytes
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.identity.tenant import Tenant
from store.plan import plan_from_prefixes
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
if "max_file_bytes" in FleetMemoryConfig.model_fields:  # where records are capped: at the least allowed
    CONFIG_DOC["fleet_memory"]["max_file_bytes"] = 64 << 10

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
    publish(plan_from_prefixes("acme", [STORED], created_at=time.time()), store.tiers, key_root)
    recorder = FleetRecorder(store.tiers, OTHER_NODE)
    recorder.record(names)
    recorder.flush()
    store.close()
    for kind, rel in PATHS.items():
        if (nvme / rel).is_file():
            genuine[kind] = (nvme / rel).read_bytes()
    return Template(root, tuple(names), genuine)


def publish(plan: Any, tiers: Any, key_root: Any) -> None:
    """Publish ``plan`` as the pipeline does: keyed by the salted block keys where the published
    plan holds no prompts (store.published_plan), else as it is (the format before issue 31)."""
    try:
        from store.published_plan import key_plan, publish_plan
    except ImportError:
        from store.plan import publish_plan  # type: ignore[attr-defined,no-redef]

        publish_plan(plan, tiers)
        return
    publish_plan(key_plan(plan, lambda tenant, chat: key_root), tiers)


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


def value_paths(doc: Any, at: tuple = (), depth: int = 0) -> list[tuple]:
    """Every value's path in ``doc`` (lists: their first three items only)."""
    out = [at]
    if depth > 6:
        return out
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += value_paths(v, at + (k,), depth + 1)
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += value_paths(v, at + (i,), depth + 1)
    return out


def apply_change(doc: Any, op: str, path: tuple, value: Any) -> Any:
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
        path = draw(st.sampled_from(value_paths(doc)))
        op = draw(st.sampled_from(["set", "set", "set", "del", "add", "grow"]))
        value = draw(values)
        try:
            doc = apply_change(doc, op, path, value)
        except (KeyError, IndexError, TypeError):
            continue
        how.append(f"{op} {'/'.join(map(str, path)) or '<root>'} = {value!r}"[:200])
    return Hostile("json: " + "; ".join(how), dumps(doc))


NESTED = b"[" * 2000 + b"]" * 2000  # past the JSON parsers' depth (RecursionError in the stdlib's)
BIG_NUMBER = b'{"salt_id":' + b"1" * 5000 + b"}"  # past Python's 4300-digit limit (a plain ValueError)


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
    if kind == "bigint":
        return Hostile("a 5000-digit number", BIG_NUMBER)
    return Hostile("not UTF-8", b"\xff\xfe" + raw[: len(raw) // 2] + b"\xc3\x28")


def record_mutations(raw: bytes | None) -> st.SearchStrategy[Hostile]:
    """Hostile versions of a genuine JSON record (or of a small object when there is none)."""
    base = raw if raw is not None else b'{"kvwarm_plan":2,"entries":[]}'
    return st.one_of(json_mutations(base), byte_mutations(base))


# -- seeds: the issue's reproduced attacks and the parsers' limits, tried on every run ---------


class Seed:
    """A hostile record made from the genuine one (``make``), named for the test's id."""

    def __init__(self, how: str, make: Callable[[bytes], bytes], *, refused: bool = True) -> None:
        self.how, self.make, self.refused = how, make, refused  # refused: no reader may take it

    def __call__(self, genuine: bytes) -> Hostile:
        return Hostile(self.how, self.make(genuine))

    def __repr__(self) -> str:
        return self.how


def _doc_seed(how: str, change: Callable[[dict], Any], *, refused: bool = True) -> Seed:
    def make(genuine: bytes) -> bytes:
        doc = json.loads(genuine)
        return dumps(change(doc) or doc)
    return Seed(how, make, refused=refused)


def _raw_seed(how: str, data: bytes) -> Seed:
    return Seed(how, lambda genuine: data)


_COMMON = [_raw_seed("empty", b""), _raw_seed("not UTF-8", b"\xff\xfe{\x80}"), _raw_seed("nested 2000 deep", NESTED),
           _raw_seed("a 5000-digit number", BIG_NUMBER), _raw_seed("a list", b"[1, 2]"), _raw_seed("null", b"null")]
SEEDS: dict[str, list[Seed]] = {
    "owner": _COMMON + [
        _doc_seed("no salt_id", lambda d: d.pop("salt_id", None) and None),
        _doc_seed("salt_id null", lambda d: d.update(salt_id=None)),
        _doc_seed("salt_id a number", lambda d: d.update(salt_id=7)),
    ],
    "plan": _COMMON + [
        _doc_seed("created_at a string", lambda d: d.update(created_at="yesterday")),
        _doc_seed("window.start a string", lambda d: d.update(window={"start": "x", "end": 1.0})),
        _doc_seed("extra a string", lambda d: d.update(extra="x")),
        _doc_seed("as_of NaN, created_at Infinity", lambda d: d.update(as_of=math.nan, created_at=math.inf)),
        _doc_seed("an entry's score a string", lambda d: [e.update(score="high") for e in d.get("entries", [])] and None),
    ],
    "fleet": _COMMON + [
        _doc_seed("written_at 1e300", lambda d: d.update(written_at=1e300)),
        _doc_seed("written_at NaN", lambda d: d.update(written_at=math.nan)),
        _doc_seed("negative ages", lambda d: d.update(age_s=[-1e6 for _ in d["age_s"]])),
        # no bound is named for uses: a huge count must not break a reader, refused or not
        _doc_seed("uses 10**12", lambda d: d.update(uses=[10**12 for _ in d["uses"]]), refused=False),
        _doc_seed("uses true", lambda d: d.update(uses=[True for _ in d["uses"]])),
        _doc_seed("traffic_age NaN", lambda d: d.update(traffic_age=[math.nan for _ in d["traffic_age"]])),
    ],
}
