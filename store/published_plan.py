"""The published plan: what serving nodes read, with no prompt in it.

The pipeline publishes each plan it makes to every tier's metadata area
(:data:`LATEST_PLAN`, ``plans/latest.json``), where every serving node can read it, and so
can anyone who can read the bucket's metadata. So the published plan names no prompt: each
entry names its prefix by the salted block keys the prefill job writes it under (the chain
of :func:`store.identity.keys.block_keys`, under the tenant's secret salt), which reveal
nothing without that salt. The plan with the prompts stays in the pipeline's private run
directory (:mod:`store.plan`, :mod:`store.plan_seal`). The format (docs/reference/plan.md)::

    {"kvwarm_published_plan": 1, "created_at": 1764400000.0, "as_of": ..., "block_size": 256,
     "model": "kvwarm-tiny", "window": {"start": ..., "end": ...}, "extra": {"horizon_s": 60.0},
     "entries": [{"namespace": "acme", "root": "9f2c...", "keys": ["ab12...", ...], "action": "retain",
                  "score": 0.8, "expected_hits": 3.0, "urgency": 0.4, "ttl_s": 14400, "bytes": 1048576}]}

``root`` is :func:`root_id` of the key root the keys chain from (model, tokenizer, chat
template, precision, block size, format and the tenant's salt): a one-way digest of the
root key, so it lets a node check it keys prefixes the same way (a node whose root differs
skips the entry, counted) without letting anyone compute keys of guessed prompts. Entries
are in the private plan's priority order; ``hash_ids`` entries (trace ids a loader cannot
key) and prefixes shorter than one block are not published.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from store.errors import StoreFull, StoreRecordInvalid, StoreUnavailable
from store.identity.keys import BlockKey, KeyRoot, block_keys, root_key
from store.plan import (
    ACTIONS,
    MAX_IDS,
    MAX_PLAN_BYTES,
    Plan,
    PlanError,
    check_header,
    check_text,
    decode_json,
    header_json,
    is_number,
    plan_fields,
)

if TYPE_CHECKING:
    from store.tiers.base import Tier

PUBLISHED_VERSION = 1
#: Where :func:`publish_plan` puts the latest plan in each tier's metadata area.
LATEST_PLAN = "plans/latest.json"
#: Beside it, the latest plan's version (a digest of its bytes): what a node agent polls.
LATEST_VERSION = "plans/latest.version"
#: the private plan's ``extra`` items a node uses, and the only ones published
PUBLISHED_EXTRA = ("fleet_reuse", "horizon_s")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_ROOT_ID = re.compile(r"[0-9a-f]{32}")
_ENTRY_FIELDS = {"namespace", "root", "keys", "action", "chat", "score", "expected_hits", "urgency", "ttl_s",
                 "bytes"}
_PLAN_FIELDS = {"kvwarm_published_plan", "created_at", "as_of", "block_size", "model", "window", "extra", "entries"}


def root_id(root: KeyRoot) -> str:
    """A public fingerprint of a key root: a one-way digest of its root key (32 hex digits).

    Unlike the root key it does not let anyone chain keys for guessed tokens.
    """
    return hashlib.sha256(b"kvwarm/plan-root/v1\x00" + bytes.fromhex(root_key(root))).hexdigest()[:32]


@dataclass(frozen=True)
class PublishedEntry:
    """One prefix of a published plan: its namespace, key root and block keys, and what to do."""

    namespace: str
    root: str
    keys: tuple[BlockKey, ...]
    action: str = "prefill"
    chat: bool = False
    score: float = 0.0
    expected_hits: float = 0.0
    urgency: float | None = None
    ttl_s: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        check_text("published plan entry", "namespace", self.namespace, limit=63, optional=False)
        where = f"published plan entry for {self.namespace!r}"
        if not isinstance(self.root, str) or not _ROOT_ID.fullmatch(self.root):
            raise PlanError(f"{where}: 'root' must be 32 lower-case hex digits (a key root's id)")
        if not (isinstance(self.keys, (list, tuple)) and 0 < len(self.keys) <= MAX_IDS
                and all(isinstance(k, str) and _HEX64.fullmatch(k) for k in self.keys)):
            raise PlanError(f"{where}: 'keys' must be a non-empty list of block keys (64 lower-case hex digits)")
        object.__setattr__(self, "keys", tuple(self.keys))
        if self.action not in ACTIONS:
            raise PlanError(f"{where}: 'action' must be one of {', '.join(ACTIONS)}")
        if not isinstance(self.chat, bool):
            raise PlanError(f"{where}: 'chat' must be true or false, got {type(self.chat).__name__}")
        for name in ("score", "expected_hits"):
            if not is_number(getattr(self, name)):
                raise PlanError(f"{where}: {name!r} must be a finite number, got {type(getattr(self, name)).__name__}")
        if self.urgency is not None and not (is_number(self.urgency) and self.urgency >= 0):
            raise PlanError(f"{where}: 'urgency' must be a number >= 0")
        if self.ttl_s is not None and not (is_number(self.ttl_s) and self.ttl_s > 0):
            raise PlanError(f"{where}: 'ttl_s' must be a positive number of seconds")
        if self.bytes is not None and not (isinstance(self.bytes, int) and not isinstance(self.bytes, bool)
                                           and 0 <= self.bytes < 1 << 62):
            raise PlanError(f"{where}: 'bytes' must be a non-negative integer")

    @property
    def blocks(self) -> int:
        """The prefix's size in blocks."""
        return len(self.keys)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"namespace": self.namespace, "root": self.root, "keys": list(self.keys)}
        for name in ("action", "chat", "score", "expected_hits", "urgency", "ttl_s", "bytes"):
            v = getattr(self, name)
            if v is not None and not (name == "chat" and v is False) and not (name == "action" and v == "prefill"):
                d[name] = v
        return d


@dataclass(frozen=True)
class PublishedPlan:
    """A plan as serving nodes read it: keyed entries in priority order, plus when and for what model."""

    entries: tuple[PublishedEntry, ...]
    created_at: float = 0.0
    block_size: int | None = None
    model: str | None = None
    window_start: float | None = None
    window_end: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    as_of: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        check_header(self, "published plan")

    def to_json(self) -> dict[str, Any]:
        return {**header_json(self, "kvwarm_published_plan", PUBLISHED_VERSION),
                "entries": [e.to_json() for e in self.entries]}


#: the key root a tenant's prompts are keyed under (plain or through the chat template), or
#: ``None`` when its entries cannot be keyed here
RootFor = Callable[[str, bool], "KeyRoot | None"]


def key_plan(plan: Plan, root_for: RootFor, encode: Callable[[str, bool], Sequence[int]] | None = None
             ) -> PublishedPlan:
    """``plan`` (with its prompts, opened) as the plan serving nodes read: each entry's prompt
    replaced by its chain of block keys under ``root_for(tenant, chat)``.

    ``encode`` turns an entry's ``text`` into token ids (as the prefill job does: through the
    chat template when ``chat``). Entries that cannot be keyed are left out and counted in
    ``extra["unpublished"]`` by reason: ``hash_ids`` (trace ids, which no loader keys),
    ``text`` (no ``encode``), ``no_root`` (``root_for`` gave none), ``short`` (under one
    block). Each entry's ``bytes`` is its size at the plan's ``extra["kv_bytes_per_token"]``.

    Raises:
        PlanError: an entry is still sealed (open the plan with :func:`store.plan_seal.open_plan`).
    """
    per_token = plan.extra.get("kv_bytes_per_token")
    per_token = float(per_token) if is_number(per_token) and per_token > 0 else None
    left: dict[str, int] = {}
    out = []
    for e in plan.entries:
        if e.sealed is not None:
            raise PlanError(f"plan entry for tenant {e.tenant!r} is sealed: open the plan before publishing it")
        reason = None
        root = root_for(e.tenant, e.chat) if e.hash_ids is None else None
        if e.hash_ids is not None:
            reason = "hash_ids"
        elif root is None:
            reason = "no_root"
        elif e.token_ids is None and encode is None:
            reason = "text"
        if reason is None:
            assert root is not None
            ids = e.token_ids if e.token_ids is not None else encode(e.text or "", e.chat)  # type: ignore[misc]
            keys = block_keys(root, list(ids))
            if not keys:
                reason = "short"
        if reason is not None:
            left[reason] = left.get(reason, 0) + 1
            continue
        size = None if per_token is None else int(len(keys) * root.block_size * per_token)  # type: ignore[union-attr]
        out.append(PublishedEntry(namespace=e.tenant, root=root_id(root), keys=tuple(keys),  # type: ignore[arg-type]
                                  action=e.action, chat=e.chat, score=e.score, expected_hits=e.expected_hits,
                                  urgency=e.urgency, ttl_s=e.ttl_s, bytes=size))
    extra = {k: plan.extra[k] for k in PUBLISHED_EXTRA if k in plan.extra}
    if left:
        extra["unpublished"] = left
    return PublishedPlan(entries=tuple(out), created_at=plan.created_at, block_size=plan.block_size,
                         model=plan.model, window_start=plan.window_start, window_end=plan.window_end,
                         extra=extra, as_of=plan.as_of)


def parse_published(doc: Any, source: str = "published plan") -> PublishedPlan:
    """Validate a decoded published plan: every field's type and bounds.

    Raises:
        PlanError: naming the entry and the field, and the type it must have (a plan in the
            private format, with prompts, is refused too).
    """
    if isinstance(doc, dict) and "kvwarm_plan" in doc:
        raise PlanError(f"{source} is a private plan (with prompts), not a published one: publish plans with "
                        f"this kvwarm's pipeline (store.published_plan.key_plan)")
    raw, fields = plan_fields(doc, source, _PLAN_FIELDS, "kvwarm_published_plan", (PUBLISHED_VERSION,))
    entries = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            raise PlanError(f"{source}: entry {i} must be an object, got {type(e).__name__}")
        bad = set(e) - _ENTRY_FIELDS
        if bad or not {"namespace", "root", "keys"} <= set(e):
            raise PlanError(f"{source}: entry {i} must have 'namespace', 'root' and 'keys', and only "
                            f"{sorted(_ENTRY_FIELDS)}")
        try:
            entries.append(PublishedEntry(**e))
        except PlanError as exc:
            raise PlanError(f"{source}: entry {i}: {exc}") from None
    try:
        return PublishedPlan(entries=tuple(entries), **fields)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None


def publish_plan(plan: PublishedPlan, tiers: Sequence["Tier"]) -> int:
    """Make ``plan`` the store's latest (``LATEST_PLAN`` in every tier's metadata area); returns tiers written.

    Serving nodes read it back with :func:`latest_plan` (a KV connector with ``plan: latest``),
    so the plan is found with the store alone. A tier that cannot be reached is skipped.

    Raises:
        PlanError: ``plan`` is a private plan (key it first: :func:`key_plan`).
        StoreUnavailable: no tier could be written.
    """
    if not isinstance(plan, PublishedPlan):
        raise PlanError("only a keyed plan is published (store.published_plan.key_plan): a private plan names "
                        "prompts, and every reader of the store's metadata would read them")
    import json

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
            return raw[:64].decode("ascii", "replace").strip()
    return None


def latest_plan(tiers: Sequence["Tier"]) -> PublishedPlan | None:
    """The plan last published to these tiers (the fastest tier that has it), or ``None``.

    Raises:
        PlanError: the published plan is larger than :data:`store.plan.MAX_PLAN_BYTES`
            (refused before it is decoded) or not a valid published plan.
    """
    for tier in tiers:
        where = tier.describe(LATEST_PLAN)
        try:
            raw = tier.get_meta_capped(LATEST_PLAN, MAX_PLAN_BYTES)  # refused unread where the tier knows its size
        except StoreRecordInvalid as exc:
            raise PlanError(f"the latest plan in {where}: {exc}") from None
        except (StoreUnavailable, OSError):
            continue
        if raw is not None:
            return parse_published(decode_json(raw, f"the latest plan in {where}", MAX_PLAN_BYTES), where)
    return None
