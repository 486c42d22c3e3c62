"""The prewarm plan file: what forecasting decides, prefill computes and loaders retain.

The plan is the contract between the three: ``forecasting`` writes it, the prefill job
reads it to know what to compute, and the serving-side loader reads it for prefetch and
forecast-informed retention. It lives in ``store`` because ``store`` imports nothing
else and all three may import it. The format is documented in ``docs/reference/plan.md``.

A plan is a JSON object (``*.json``) or a Parquet table of entries with the plan's
own fields in the schema metadata (``*.parquet``)::

    {"kvwarm_plan": 2, "created_at": 1764400000.0, "as_of": 1764399900.0, "block_size": 256,
     "model": "kvwarm-tiny", "window": {"start": ..., "end": ...},
     "entries": [{"tenant": "acme", "text": "You are...", "ttl_s": 14400, "score": 3.2,
                  "expected_hits": 41.0, "family": "f-12", "prefix_id": "ab12..."},
                 {"tenant": "acme", "action": "retain", "token_ids": [...], "score": 0.8}]}

Each entry names a prefix as ``token_ids``, as ``text`` (tokenised by the prefill job
with the model's tokenizer, through the chat template when ``chat`` is true) or as
``hash_ids`` (one chained id per block, as logs in the Mooncake format name prompts).
Its ``action`` says what the plan decided (version 2): ``prefill`` it in the off-peak
window (the default, and every entry of a version-1 plan), or ``retain`` it, a prefix
already stored that serving nodes prefetch and keep. Entries are in priority order
(one value model ranks both kinds): the prefill job computes the ``prefill`` entries in
order and stops at its deadline, so the most valuable prefixes are done first; loaders
prefetch every entry in order. A ``retain`` entry may carry an ``urgency`` (its expected
uses in the next minute or so): the planner orders the ``retain`` entries' places by it,
so the copies needed soonest come first. Readers accept versions 1 and 2.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from store.errors import ConfigError, StoreFull, StoreUnavailable

if TYPE_CHECKING:
    from store.tiers.base import Tier

PLAN_VERSION = 2
#: plan versions this kvwarm reads (version 1: no ``action``, ``hash_ids`` or ``as_of``)
READABLE_VERSIONS = (1, 2)
#: what a plan entry asks for: compute the prefix in the off-peak window, or keep a stored one close
ACTIONS = ("prefill", "retain")
#: Where :func:`publish_plan` puts the latest plan in each tier's metadata area.
LATEST_PLAN = "plans/latest.json"
#: Beside it, the latest plan's version (a digest of its bytes): what a node agent polls.
LATEST_VERSION = "plans/latest.version"


class PlanError(ConfigError):
    """A plan file is missing, unreadable or names something invalid."""


@dataclass(frozen=True)
class PlanEntry:
    """One prefix to prewarm for one tenant: to prefill (``action="prefill"``) or to retain."""

    tenant: str
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    chat: bool = False
    ttl_s: float | None = None
    score: float = 0.0
    expected_hits: float = 0.0
    family: str | None = None
    prefix_id: str | None = None
    action: str = "prefill"
    hash_ids: tuple[int, ...] | None = None
    urgency: float | None = None

    def __post_init__(self) -> None:
        where = f"plan entry for tenant {self.tenant!r}"
        if not isinstance(self.tenant, str) or not self.tenant:
            raise PlanError(f"plan entry: 'tenant' must be a non-empty string, got {self.tenant!r}")
        if sum(v is not None for v in (self.token_ids, self.text, self.hash_ids)) != 1:
            raise PlanError(f"{where}: give exactly one of 'token_ids', 'text' or 'hash_ids'")
        if self.action not in ACTIONS:
            raise PlanError(f"{where}: 'action' must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        for name in ("token_ids", "hash_ids"):
            given = getattr(self, name)
            if given is None:
                continue
            ids = tuple(given)
            if not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise PlanError(f"{where}: {name!r} must be a non-empty list of non-negative integers")
            object.__setattr__(self, name, ids)
        if self.text is not None and (not isinstance(self.text, str) or not self.text):
            raise PlanError(f"{where}: 'text' must be a non-empty string")
        if self.ttl_s is not None and not (isinstance(self.ttl_s, (int, float)) and self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise PlanError(f"{where}: 'ttl_s' must be a positive number of seconds, got {self.ttl_s!r}")
        for name in ("score", "expected_hits"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise PlanError(f"{where}: {name!r} must be a finite number, got {v!r}")
        u = self.urgency
        if u is not None and (not isinstance(u, (int, float)) or isinstance(u, bool) or not math.isfinite(u) or u < 0):
            raise PlanError(f"{where}: 'urgency' must be a number >= 0 (expected uses soon), got {u!r}")

    @property
    def prefillable(self) -> bool:
        """Whether the prefill job should compute it: a ``prefill`` entry with tokens or text."""
        return self.action == "prefill" and self.hash_ids is None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("token_ids", "hash_ids"):
            if d[name] is not None:
                d[name] = list(d[name])
        return {k: v for k, v in d.items()
                if v is not None and not (k == "chat" and v is False) and not (k == "action" and v == "prefill")}


@dataclass(frozen=True)
class Plan:
    """A prewarm plan: entries in priority order, plus when and for what model."""

    entries: tuple[PlanEntry, ...]
    created_at: float = 0.0
    block_size: int | None = None
    model: str | None = None
    window_start: float | None = None
    window_end: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    as_of: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size <= 0):
            raise PlanError(f"plan: 'block_size' must be a positive integer, got {self.block_size!r}")
        if self.window_start is not None and self.window_end is not None and self.window_end <= self.window_start:
            raise PlanError(f"plan: window end {self.window_end} is not after its start {self.window_start}")

    def prefill_entries(self) -> list[PlanEntry]:
        """The entries the prefill job computes, in order (:attr:`PlanEntry.prefillable`)."""
        return [e for e in self.entries if e.prefillable]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kvwarm_plan": PLAN_VERSION, "created_at": self.created_at}
        if self.as_of is not None:
            out["as_of"] = self.as_of
        if self.block_size is not None:
            out["block_size"] = self.block_size
        if self.model is not None:
            out["model"] = self.model
        if self.window_start is not None or self.window_end is not None:
            out["window"] = {"start": self.window_start, "end": self.window_end}
        if self.extra:
            out["extra"] = self.extra
        out["entries"] = [e.to_json() for e in self.entries]
        return out


_ENTRY_FIELDS = {f for f in PlanEntry.__dataclass_fields__}


def parse_plan(doc: Any, source: str = "plan") -> Plan:
    """Validate a decoded plan document; errors name the entry and the field."""
    if isinstance(doc, list):  # a bare list of entries is accepted (the simplest hand-written plan)
        doc = {"kvwarm_plan": PLAN_VERSION, "entries": doc}
    if not isinstance(doc, dict):
        raise PlanError(f"{source}: a plan is a JSON object with 'entries', got {type(doc).__name__}")
    version = doc.get("kvwarm_plan", PLAN_VERSION)
    if version not in READABLE_VERSIONS:
        raise PlanError(f"{source}: plan version {version!r} is not supported (this kvwarm reads versions "
                        f"{', '.join(map(str, READABLE_VERSIONS))})")
    unknown = set(doc) - {"kvwarm_plan", "created_at", "as_of", "block_size", "model", "window", "extra", "entries"}
    if unknown:
        raise PlanError(f"{source}: unknown plan field(s) {sorted(unknown)}")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise PlanError(f"{source}: 'entries' must be a list")
    entries = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            raise PlanError(f"{source}: entry {i} must be an object, got {type(e).__name__}")
        bad = set(e) - _ENTRY_FIELDS
        if bad:
            raise PlanError(f"{source}: entry {i} has unknown field(s) {sorted(bad)}; allowed: {sorted(_ENTRY_FIELDS)}")
        try:
            entries.append(PlanEntry(**e))
        except PlanError as exc:
            raise PlanError(f"{source}: entry {i}: {exc}") from None
    window = doc.get("window") or {}
    if not isinstance(window, dict):
        raise PlanError(f"{source}: 'window' must be an object with 'start' and 'end'")
    as_of = doc.get("as_of")
    if as_of is not None and not (isinstance(as_of, (int, float)) and not isinstance(as_of, bool) and math.isfinite(as_of)):
        raise PlanError(f"{source}: 'as_of' must be Unix seconds, got {as_of!r}")
    return Plan(entries=tuple(entries), created_at=float(doc.get("created_at", 0.0)),
                block_size=doc.get("block_size"), model=doc.get("model"),
                window_start=window.get("start"), window_end=window.get("end"), extra=doc.get("extra") or {},
                as_of=None if as_of is None else float(as_of))


def read_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan from ``*.json`` or ``*.parquet``."""
    p = Path(path)
    if not p.exists():
        raise PlanError(f"plan file {str(p)!r} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as exc:  # noqa: BLE001 - any reader error is a bad file
            raise PlanError(f"plan file {str(p)!r} is not a readable Parquet file: {exc}") from None
        meta = json.loads((table.schema.metadata or {}).get(b"kvwarm_plan", b"{}"))
        rows = [{k: v for k, v in r.items() if v is not None} for r in table.to_pylist()]
        return parse_plan({**meta, "entries": rows}, str(p))
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"plan file {str(p)!r} is not valid JSON: {exc}") from None
    return parse_plan(doc, str(p))


def write_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write a plan atomically (temp file + rename) as JSON or Parquet, by suffix."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plan-", dir=p.parent)
    try:
        if p.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            doc = plan.to_json()
            rows = doc.pop("entries")
            cols = {name: [r.get(name) for r in rows] for name in PlanEntry.__dataclass_fields__}
            table = pa.table(cols) if rows else pa.table({"tenant": pa.array([], pa.string())})
            table = table.replace_schema_metadata({"kvwarm_plan": json.dumps(doc)})
            os.close(fd)
            pq.write_table(table, tmp)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(plan.to_json(), f, indent=1)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def publish_plan(plan: Plan, tiers: Sequence["Tier"]) -> int:
    """Make ``plan`` the store's latest (``LATEST_PLAN`` in every tier's metadata area); returns tiers written.

    Serving nodes read it back with :func:`latest_plan` (a KV connector with ``plan: latest``),
    so the plan is found with the store alone. A tier that cannot be reached is skipped.

    Raises:
        StoreUnavailable: no tier could be written.
    """
    data = json.dumps(plan.to_json()).encode("utf-8")
    version = plan_version(data).encode("ascii")
    written, error = 0, None
    for tier in tiers:
        try:
            # the plan first: a node that sees the new version finds the plan it names
            tier.put_meta(LATEST_PLAN, data)
            tier.put_meta(LATEST_VERSION, version)
            written += 1
        except (StoreUnavailable, StoreFull, OSError) as exc:  # a full disk: the next tier may take it
            error = exc
    if not written:
        raise StoreUnavailable(f"no tier took the plan: {error}")
    return written


def plan_version(data: bytes) -> str:
    """A published plan's version: the first 16 hex digits of the SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()[:16]


def latest_plan_version(tiers: Sequence["Tier"]) -> str | None:
    """The version of the plan last published to these tiers (a few bytes read), or ``None``
    when none is published. A plan published without a version file (by an older kvwarm)
    is read whole and its digest returned."""
    for tier in tiers:
        try:
            raw = tier.get_meta(LATEST_VERSION)
            if raw is None:
                raw = tier.get_meta(LATEST_PLAN)
                if raw is not None:
                    return plan_version(raw)
        except (StoreUnavailable, OSError):
            continue
        if raw is not None:
            return raw.decode("ascii", "replace").strip()
    return None


def latest_plan(tiers: Sequence["Tier"]) -> Plan | None:
    """The plan last published to these tiers (the fastest tier that has it), or ``None``.

    Raises:
        PlanError: the published plan is not a valid plan.
    """
    for tier in tiers:
        try:
            raw = tier.get_meta(LATEST_PLAN)
        except (StoreUnavailable, OSError):
            continue
        if raw is not None:
            try:
                doc = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise PlanError(f"the latest plan in {tier.describe(LATEST_PLAN)} is not valid JSON: {exc}") from None
            return parse_plan(doc, tier.describe(LATEST_PLAN))
    return None


def plan_from_prefixes(tenant: str, prefixes: Iterable[Sequence[int] | str], **kw: Any) -> Plan:
    """A plan naming ``prefixes`` (token-id lists or texts) for one tenant, in the given order."""
    entries = [PlanEntry(tenant=tenant, text=p) if isinstance(p, str) else PlanEntry(tenant=tenant, token_ids=tuple(p))
               for p in prefixes]
    return Plan(entries=tuple(entries), **kw)
