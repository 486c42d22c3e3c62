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

Readers check every field's type and bounds (:func:`parse_plan`; a file above
:data:`MAX_PLAN_BYTES` is refused before it is read) and raise :class:`PlanError` naming the
field. This plan names prompts, so it stays private: the pipeline keeps it in its run
directory (an encrypted tenant's entries ``sealed``: :mod:`store.plan_seal`), and what it
publishes for serving nodes is the keyed form, :mod:`store.published_plan`.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from store.errors import ConfigError

PLAN_VERSION = 2
#: plan versions this kvwarm reads (version 1: no ``action``, ``hash_ids`` or ``as_of``)
READABLE_VERSIONS = (1, 2)
#: what a plan entry asks for: compute the prefix in the off-peak window, or keep a stored one close
ACTIONS = ("prefill", "retain")
#: the largest plan file (private or published) a reader takes: a larger one is refused before it is read
MAX_PLAN_BYTES = 64 << 20
#: the most token or hash ids one entry names, and the longest text
MAX_IDS = 1 << 20
MAX_TEXT = 1 << 22


class PlanError(ConfigError):
    """A plan file is missing, unreadable, too large, or names something invalid (the message names the field)."""


def is_number(v: Any) -> bool:
    """Whether ``v`` is a finite JSON number (``true``/``false`` are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ids(v: Any) -> bool:
    return (isinstance(v, (list, tuple)) and bool(v) and len(v) <= MAX_IDS
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in v))


def check_text(where: str, name: str, v: Any, *, limit: int = 256, optional: bool = True) -> None:
    """Refuse (:class:`PlanError`) unless ``v`` is a string of at most ``limit`` characters (or ``None``)."""
    if v is None and optional:
        return
    if not isinstance(v, str) or len(v) > limit:
        raise PlanError(f"{where}: {name!r} must be a string of at most {limit} characters, got "
                        f"{type(v).__name__}")


@dataclass(frozen=True)
class PlanEntry:
    """One prefix to prewarm for one tenant: to prefill (``action="prefill"``) or to retain.

    The prefix is named by exactly one of ``token_ids``, ``text``, ``hash_ids`` or ``sealed``
    (``token_ids``, ``text`` or ``hash_ids`` encrypted with the tenant's key:
    :mod:`store.plan_seal`; the pipeline's run directory holds an encrypted tenant's entries so).
    """

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
    sealed: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant or len(self.tenant) > 63:
            raise PlanError(f"plan entry: 'tenant' must be a non-empty string, got {self.tenant!r}"[:200])
        where = f"plan entry for tenant {self.tenant!r}"
        if sum(v is not None for v in (self.token_ids, self.text, self.hash_ids, self.sealed)) != 1:
            raise PlanError(f"{where}: give exactly one of 'token_ids', 'text' or 'hash_ids' "
                            f"(or 'sealed', the pipeline's encrypted form of one of them)")
        if self.action not in ACTIONS:
            raise PlanError(f"{where}: 'action' must be one of {', '.join(ACTIONS)}, got {self.action!r}"[:300])
        for name in ("token_ids", "hash_ids"):
            given = getattr(self, name)
            if given is None:
                continue
            if not _ids(given):
                raise PlanError(f"{where}: {name!r} must be a non-empty list of non-negative integers "
                                f"(at most {MAX_IDS})")
            object.__setattr__(self, name, tuple(given))
        if self.text is not None and (not isinstance(self.text, str) or not self.text or len(self.text) > MAX_TEXT):
            raise PlanError(f"{where}: 'text' must be a non-empty string of at most {MAX_TEXT} characters")
        if self.sealed is not None and (not isinstance(self.sealed, str) or not self.sealed
                                        or len(self.sealed) > 2 * MAX_TEXT):
            raise PlanError(f"{where}: 'sealed' must be a non-empty string (base64)")
        if not isinstance(self.chat, bool):
            raise PlanError(f"{where}: 'chat' must be true or false, got {type(self.chat).__name__}")
        if self.ttl_s is not None and not (is_number(self.ttl_s) and self.ttl_s > 0):
            raise PlanError(f"{where}: 'ttl_s' must be a positive number of seconds, got {self.ttl_s!r}"[:300])
        for name in ("score", "expected_hits"):
            v = getattr(self, name)
            if not is_number(v):
                raise PlanError(f"{where}: {name!r} must be a finite number, got {v!r}"[:300])
        u = self.urgency
        if u is not None and not (is_number(u) and u >= 0):
            raise PlanError(f"{where}: 'urgency' must be a number >= 0 (expected uses soon), got {u!r}"[:300])
        check_text(where, "family", self.family)
        check_text(where, "prefix_id", self.prefix_id)

    @property
    def prefillable(self) -> bool:
        """Whether the prefill job should compute it: a ``prefill`` entry with tokens or text."""
        return self.action == "prefill" and (self.token_ids is not None or self.text is not None)

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
        check_header(self, "plan")

    def prefill_entries(self) -> list[PlanEntry]:
        """The entries the prefill job computes, in order (:attr:`PlanEntry.prefillable`)."""
        return [e for e in self.entries if e.prefillable]

    def to_json(self) -> dict[str, Any]:
        return {**header_json(self, "kvwarm_plan", PLAN_VERSION), "entries": [e.to_json() for e in self.entries]}


def header_json(plan: Any, version_key: str, version: int) -> dict[str, Any]:
    """A plan's own fields as the file holds them, before its entries (:class:`Plan` and
    :class:`store.published_plan.PublishedPlan` write them alike)."""
    out: dict[str, Any] = {version_key: version, "created_at": plan.created_at}
    for name in ("as_of", "block_size", "model"):
        if getattr(plan, name) is not None:
            out[name] = getattr(plan, name)
    if plan.window_start is not None or plan.window_end is not None:
        out["window"] = {"start": plan.window_start, "end": plan.window_end}
    if plan.extra:
        out["extra"] = plan.extra
    return out


def check_header(plan: Any, where: str) -> None:
    """Refuse (:class:`PlanError`) a plan whose own fields (not its entries) have the wrong type or bounds.

    Shared by :class:`Plan` and :class:`store.published_plan.PublishedPlan`.
    """
    if not is_number(plan.created_at):
        raise PlanError(f"{where}: 'created_at' must be a finite number (Unix seconds), got "
                        f"{type(plan.created_at).__name__}")
    if plan.as_of is not None and not is_number(plan.as_of):
        raise PlanError(f"{where}: 'as_of' must be Unix seconds, got {plan.as_of!r}"[:300])
    if plan.block_size is not None and not (isinstance(plan.block_size, int) and not isinstance(plan.block_size, bool)
                                            and 0 < plan.block_size <= 1 << 20):
        raise PlanError(f"{where}: 'block_size' must be a positive integer, got {plan.block_size!r}"[:300])
    check_text(where, "model", plan.model, limit=1024)
    for name in ("window_start", "window_end"):
        v = getattr(plan, name)
        if v is not None and not is_number(v):
            raise PlanError(f"{where}: 'window.{name[7:]}' must be a finite number (Unix seconds), got "
                            f"{type(v).__name__}")
    if plan.window_start is not None and plan.window_end is not None and plan.window_end <= plan.window_start:
        raise PlanError(f"{where}: window end {plan.window_end} is not after its start {plan.window_start}")
    if not isinstance(plan.extra, dict):
        raise PlanError(f"{where}: 'extra' must be a JSON object, got {type(plan.extra).__name__}")


_ENTRY_FIELDS = {f for f in PlanEntry.__dataclass_fields__}
_PLAN_FIELDS = {"kvwarm_plan", "created_at", "as_of", "block_size", "model", "window", "extra", "entries"}


def plan_fields(doc: Any, source: str, fields: set[str], version_key: str, versions: tuple[int, ...]
                ) -> tuple[list[Any], dict[str, Any]]:
    """A decoded plan document's entries (unchecked) and its own fields as :class:`Plan` keywords
    (checked by its ``__post_init__``); shared by the private and the published plan."""
    if not isinstance(doc, dict):
        raise PlanError(f"{source}: a plan is a JSON object with 'entries', got {type(doc).__name__}")
    version = doc.get(version_key)
    if version not in versions or isinstance(version, bool):
        raise PlanError(f"{source}: plan version {version!r} is not supported (this kvwarm reads versions "
                        f"{', '.join(map(str, versions))})"[:300])
    unknown = set(doc) - fields
    if unknown:
        raise PlanError(f"{source}: unknown plan field(s) {sorted(map(str, unknown))[:10]}")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise PlanError(f"{source}: 'entries' must be a list, got {type(raw).__name__}")
    window = doc.get("window")
    window = {} if window is None else window
    if not isinstance(window, dict) or set(window) - {"start", "end"}:
        raise PlanError(f"{source}: 'window' must be an object with 'start' and 'end'")
    extra = doc.get("extra")
    as_float = lambda v: float(v) if is_number(v) else v  # noqa: E731 - checked by the plan's __post_init__
    return raw, dict(created_at=as_float(doc.get("created_at", 0.0)), block_size=doc.get("block_size"), model=doc.get("model"),
                     window_start=window.get("start"), window_end=window.get("end"),
                     extra={} if extra is None else extra, as_of=as_float(doc.get("as_of")))


def parse_plan(doc: Any, source: str = "plan") -> Plan:
    """Validate a decoded plan document: every field's type and bounds.

    Raises:
        PlanError: naming the entry and the field, and the type it must have.
    """
    if isinstance(doc, list):  # a bare list of entries is accepted (the simplest hand-written plan)
        doc = {"kvwarm_plan": PLAN_VERSION, "entries": doc}
    if isinstance(doc, dict) and "kvwarm_plan" not in doc:
        doc = {**doc, "kvwarm_plan": PLAN_VERSION}
    raw, fields = plan_fields(doc, source, _PLAN_FIELDS, "kvwarm_plan", READABLE_VERSIONS)
    entries = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            raise PlanError(f"{source}: entry {i} must be an object, got {type(e).__name__}")
        bad = set(e) - _ENTRY_FIELDS
        if bad:
            raise PlanError(f"{source}: entry {i} has unknown field(s) {sorted(map(str, bad))[:10]}; "
                            f"allowed: {sorted(_ENTRY_FIELDS)}")
        try:
            entries.append(PlanEntry(**e))
        except PlanError as exc:
            raise PlanError(f"{source}: entry {i}: {exc}") from None
    try:
        return Plan(entries=tuple(entries), **fields)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None


def read_bounded(path: Path, cap: int = MAX_PLAN_BYTES) -> bytes:
    """The bytes of plan file ``path``, refused before they are read when above ``cap``.

    Raises:
        PlanError: missing, unreadable, or larger than ``cap``.
    """
    try:
        size = path.stat().st_size
        if size > cap:
            raise PlanError(f"plan file {str(path)!r} is {size} bytes, above the {cap}-byte limit of a plan")
        with path.open("rb") as f:
            data = f.read(cap + 1)
    except FileNotFoundError:
        raise PlanError(f"plan file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise PlanError(f"plan file {str(path)!r} cannot be read: {exc}") from None
    if len(data) > cap:
        raise PlanError(f"plan file {str(path)!r} is above the {cap}-byte limit of a plan")
    return data


def decode_json(data: bytes, source: str, cap: int = MAX_PLAN_BYTES) -> Any:
    """``data`` (a plan's bytes) decoded as JSON, refused above ``cap`` bytes before decoding.

    Raises:
        PlanError: too large, not UTF-8, or not JSON.
    """
    if len(data) > cap:
        raise PlanError(f"{source} is {len(data)} bytes, above the {cap}-byte limit of a plan")
    # A plan's objects and lists each hold an entry's worth of text (a key is 64 characters): a file
    # dense with them ({"entries": [[], [], ...]}) would cost ~30x its size once parsed. Refused unparsed.
    containers = data.count(b"[") + data.count(b"{")
    if containers > 64 + len(data) // 32:
        raise PlanError(f"{source} holds {containers} JSON objects and lists in {len(data)} bytes: not a plan "
                        "(a plan's entries are larger than that)")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PlanError(f"{source} is not valid JSON: {exc}"[:500]) from None


def read_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan from ``*.json`` or ``*.parquet`` (at most :data:`MAX_PLAN_BYTES`).

    Raises:
        PlanError: missing, too large, unreadable, or not a valid plan (the message names the field).
    """
    p = Path(path)
    if p.suffix == ".parquet":
        import io

        import pyarrow.parquet as pq

        data = read_bounded(p)
        try:
            table = pq.read_table(io.BytesIO(data))
            meta = decode_json((table.schema.metadata or {}).get(b"kvwarm_plan", b"{}"), str(p))
            rows = [{k: v for k, v in r.items() if v is not None} for r in table.to_pylist()]
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - any reader error is a bad file
            raise PlanError(f"plan file {str(p)!r} is not a readable Parquet file: {exc}"[:500]) from None
        if not isinstance(meta, dict):
            raise PlanError(f"plan file {str(p)!r}: its 'kvwarm_plan' metadata must be a JSON object")
        return parse_plan({**meta, "entries": rows}, str(p))
    return parse_plan(decode_json(read_bounded(p), f"plan file {str(p)!r}"), str(p))


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


def plan_from_prefixes(tenant: str, prefixes: Iterable[Sequence[int] | str], **kw: Any) -> Plan:
    """A plan naming ``prefixes`` (token-id lists or texts) for one tenant, in the given order."""
    entries = [PlanEntry(tenant=tenant, text=p) if isinstance(p, str) else PlanEntry(tenant=tenant, token_ids=tuple(p))
               for p in prefixes]
    return Plan(entries=tuple(entries), **kw)
