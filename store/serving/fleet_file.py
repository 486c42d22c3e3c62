"""Fleet files: one node's record of one namespace, ``fleet/<namespace>/<node_id>.json`` in a
tier's metadata area, and :func:`read_fleet`, which merges every node's records.

The format (docs/reference/fleet.md): one JSON object, columns newest first, ages relative to
``written_at``. A reader opens only the namespaces it is given. Every file is checked before
use (:func:`decode`): its size against a cap before it is read, then its shape, its times and
its counts against bounds. A file that fails is skipped and counted (``corrupt``), never raised,
and none of its names is used.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass, replace
from itertools import pairwise
from operator import attrgetter
from typing import Any, Iterator, Sequence

from store.config_sections import NODE_ID
from store.errors import StoreError, StoreRecordInvalid
from store.identity.tenant import check_tenant_name
from store.tiers.base import SUFFIX, Tier
from store.tiers.stats import StoreStats

log = logging.getLogger("kvwarm.fleet")

#: the ``format`` of a fleet file; a reader skips (and counts) any other
FORMAT = "kvwarm-fleet/1"
#: the fields of a fleet file, all required, no other allowed
FIELDS = frozenset({"format", "namespace", "node", "written_at", "traffic", "window_s", "keys", "age_s", "uses",
                    "traffic_age"})
#: the default cap on a fleet file's size (``fleet_memory.max_file_bytes``)
MAX_FILE_BYTES = 8 << 20
#: the largest request counter a file may hold: 10,000 requests a second for 30 years
MAX_COUNT = 10**13
#: the most names a file may hold (``fleet_memory.max_names``' ceiling; the file cap bounds it first)
MAX_ENTRIES = 10_000_000
#: how far past the reader's clock a file's ``written_at`` may be (clocks of nodes differ)
MAX_SKEW_S = 300.0
#: what a failing tier can raise; each is logged and counted, never raised
TIER_ERRORS = (StoreError, OSError)
_KEY = re.compile(r"[0-9a-f]{64}")

Entry = tuple[float, int, int]  # (at, uses, traffic at the last use); immutable, so a flush copies no values


def fleet_file(namespace: str, node: str) -> str:
    """The metadata name of ``node``'s record of ``namespace``."""
    return f"fleet/{check_tenant_name(namespace)}/{check_node_id(node)}.json"


def check_node_id(node: str) -> str:
    """Validate a node id (it names a file in every tier).

    Raises:
        ValueError: not 1-128 characters of ``[A-Za-z0-9_.-]`` starting with a letter or digit.
    """
    if not isinstance(node, str) or not NODE_ID.fullmatch(node):
        raise ValueError(f"node id {node!r} is not allowed: use 1-128 characters of A-Z a-z 0-9 _ . -, "
                         "starting with a letter or digit")
    return node


@dataclass(frozen=True, slots=True)
class Use:
    """What the fleet recorded of one block.

    Attributes:
        name: the block's tier object name (``<namespace>/<kk>/<key>.kvw``, salted).
        at: unix seconds of its last use (by any node).
        uses: how many requests used it (summed over nodes), counted since it entered a
            node's record (it leaves after ``window_s`` unused).
        traffic: the namespace's request counter on the node that used it last, at that use.
        node: the node that used it last.
        traffic_age: the namespace's requests served since its last use, by the node where that
            count is smallest (measured when each node last wrote its record): its age in traffic.
    """

    name: str
    at: float
    uses: int
    traffic: int
    node: str
    traffic_age: int = 0


def encode(ns: str, node: str, t: float, counter: int, window_s: float,
           items: Sequence[tuple[str, Entry]]) -> bytes:
    """A fleet file (docs/reference/fleet.md): columns, newest first, ages relative to ``written_at``.

    ``counter`` is the namespace's own request counter: nothing in the file depends on another
    namespace's requests. A use recorded later than ``t`` (a clock that stepped back) moves
    ``written_at`` up to it, so that no age is negative.
    """
    t = max(t, max((e[0] for _, e in items), default=t))
    doc = {
        "format": FORMAT, "namespace": ns, "node": node, "written_at": t, "traffic": counter, "window_s": window_s,
        "keys": [k for k, _ in items],
        "age_s": [round(t - e[0], 3) for _, e in items],
        "uses": [e[1] for _, e in items],
        "traffic_age": [counter - e[2] for _, e in items],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def encode_capped(ns: str, node: str, t: float, counter: int, window_s: float,
                  items: Sequence[tuple[str, Entry]], max_bytes: int) -> tuple[bytes, int]:
    """:func:`encode`, leaving out the oldest names until the file holds at most ``max_bytes``
    (a reader skips a larger one); returns the file and how many names were left out."""
    data, kept = encode(ns, node, t, counter, window_s, items), len(items)
    while len(data) > max_bytes and kept:
        kept = min(kept - 1, int(kept * max_bytes / len(data) * 0.98))  # newest first: the tail goes
        data = encode(ns, node, t, counter, window_s, items[:kept])
    return data, len(items) - kept


@dataclass(frozen=True)
class FleetFile:
    """One node's record of one namespace, as read back and checked (its columns as parsed:
    :meth:`entries` derives each entry as it is used, so a read builds no second copy of them)."""

    node: str
    written_at: float
    traffic: int
    keys: list[str]
    age_s: list[float]
    uses: list[int]
    traffic_age: list[int]

    def entries(self, *, release: bool = False) -> Iterator[tuple[str, float, int, int]]:
        """``(key, at, uses, traffic at the last use)``, newest first.

        With ``release``, each entry's values are let go as it is yielded (a reader that goes
        through them once holds no more than one copy of the record at a time); the file
        yields nothing more after that.
        """
        t, c = self.written_at, self.traffic
        keys, ages, uses, tages = self.keys, self.age_s, self.uses, self.traffic_age
        for i in range(len(keys)):
            key = keys[i]
            if key is None:
                return  # released by an earlier pass
            yield key, t - ages[i], uses[i], c - tages[i]
            if release:
                keys[i] = ages[i] = tages[i] = None  # type: ignore[call-overload]


def _real(x: Any) -> bool:
    """A finite JSON number (``true`` is not one)."""
    return type(x) in (int, float) and math.isfinite(x)


def _count(x: Any, top: int) -> bool:
    """A JSON integer in ``[0, top]`` (``true`` is not one)."""
    return type(x) is int and 0 <= x <= top


def decode(raw: bytes | str, ns: str, node: str, *, now: float) -> FleetFile:
    """Parse and check a fleet file of ``node`` for ``ns`` (its bytes, or their UTF-8 text), read
    at ``now`` (unix s).

    It must hold exactly the documented fields; ``written_at`` finite and at most
    :data:`MAX_SKEW_S` past ``now``; ``traffic`` an integer in ``[0, MAX_COUNT]``; ``window_s``
    finite and positive; columns of equal length, at most :data:`MAX_ENTRIES`; keys of 64 hex
    digits, each once; ages finite,
    in ``[0, window_s]``; ``uses`` integers in ``[1, traffic]``; ``traffic_age`` integers in
    ``[0, traffic]``.

    Raises:
        StoreRecordInvalid: the first check that failed (``location`` is the namespace and node).
    """
    where = f"fleet/{ns}/{node}.json"

    def bad(why: str) -> StoreRecordInvalid:
        return StoreRecordInvalid(f"not a valid fleet record: {why}", location=where)

    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON's, and int digits'
        raise bad(f"not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} object")
    if doc.keys() != FIELDS:
        raise bad(f"its fields are {sorted(doc)[:12]}, not {sorted(FIELDS)}")
    if doc["namespace"] != ns or doc["node"] != node:
        raise bad(f"it names namespace {str(doc['namespace'])[:80]!r} and node {str(doc['node'])[:80]!r}")
    t, counter, window = doc["written_at"], doc["traffic"], doc["window_s"]
    if not (_real(t) and t <= now + MAX_SKEW_S):
        raise bad(f"written_at {t!r:.40} is not a time up to {MAX_SKEW_S:g} s past the reader's clock")
    if not _count(counter, MAX_COUNT):
        raise bad(f"traffic {counter!r:.40} is not an integer in [0, {MAX_COUNT}]")
    if not (_real(window) and window > 0):
        raise bad(f"window_s {window!r:.40} is not a positive number")
    keys, ages, uses, tages = (doc[c] for c in ("keys", "age_s", "uses", "traffic_age"))
    if not all(type(c) is list for c in (keys, ages, uses, tages)) or not len(keys) == len(ages) == len(uses) == len(
            tages):
        raise bad("its columns are not lists of one length")
    if len(keys) > MAX_ENTRIES:
        raise bad(f"it holds {len(keys)} names, more than {MAX_ENTRIES}")
    oldest = window + 1e-3  # ages are rounded to milliseconds
    for i, key in enumerate(keys):
        if not (type(key) is str and _KEY.fullmatch(key)):
            raise bad(f"key {i} is not 64 hex digits")
        age = ages[i]
        if not (_real(age) and 0 <= age <= oldest):
            raise bad(f"age_s {i} ({age!r:.40}) is not in [0, window_s]")
        if not (_count(uses[i], counter) and uses[i] >= 1):
            raise bad(f"uses {i} ({uses[i]!r:.40}) is not an integer in [1, traffic]")
        if not _count(tages[i], counter):
            raise bad(f"traffic_age {i} ({tages[i]!r:.40}) is not an integer in [0, traffic]")
    if any(a == b for a, b in pairwise(sorted(keys))):  # a sorted list of pointers: smaller than a set
        raise bad("a key is listed twice")
    return FleetFile(node, float(t), counter, keys, ages, uses, tages)


def _text(raw: bytes, meta: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StoreRecordInvalid(f"not a valid fleet record: not UTF-8 ({exc})", location=meta) from None


def _tier_failed(stats: StoreStats | None, what: str, tier: Tier, exc: BaseException) -> None:
    """A tier that did not answer: logged and counted (``tier_failures``), never raised."""
    log.warning("fleet memory: %s in the %s tier: %s", what, tier.kind, exc)
    if stats is not None:
        stats.incr("tier_failures")


def read_file(tiers: Sequence[Tier], meta: str, ns: str, stats: StoreStats | None, *,
              max_bytes: int = MAX_FILE_BYTES, now: float | None = None) -> FleetFile | None:
    """``meta`` from the fastest tier that has a valid copy (:func:`decode`); ``None`` when none has.

    A copy over ``max_bytes`` is refused before it is read whole; it and any invalid copy are
    logged and counted (``corrupt``), and the next tier's copy is tried.
    """
    node = meta.rsplit("/", 1)[-1][: -len(".json")]
    t = time.time() if now is None else now
    for tier in tiers:
        try:
            raw = tier.get_meta_capped(meta, max_bytes)
            if raw is None:
                continue
            text = _text(raw, meta)
            del raw  # parsed from the text alone: the bytes need not stay alive beside it
            found = decode(text, ns, node, now=t)
        except StoreRecordInvalid as exc:  # another tier's copy may be whole
            log.warning("fleet memory: skipped %s in the %s tier (corrupt: %s)", meta, tier.kind, exc)
            if stats is not None:
                stats.incr("corrupt")
            continue
        except TIER_ERRORS as exc:
            _tier_failed(stats, f"{meta} unreadable", tier, exc)
            continue
        return found
    return None


def read_fleet(tiers: Sequence[Tier], namespaces: Sequence[str], *, since: float,
               exclude_node: str | None = None, stats: StoreStats | None = None,
               max_file_bytes: int = MAX_FILE_BYTES, now: float | None = None) -> list[Use]:
    """Every node's records of ``namespaces`` used at or after ``since``, merged per name, newest first
    (ties: most used first, then in the order of the request that used them: a chain's head first).

    Per name: the latest ``at`` (and its node and counter), the summed ``uses``, the smallest
    ``traffic_age`` over the nodes that used it. Each node's file is read from the fastest tier
    that lists it (a node's own local tier holds only what that host wrote; a shared tier holds
    the fleet's). Never raises for store trouble: a tier that fails is skipped, and a file that is
    over ``max_file_bytes`` or fails :func:`decode` is skipped whole, each logged and counted in
    ``stats`` (``tier_failures``, ``corrupt``).

    Args:
        namespaces: the namespaces the caller may see (its own tenant's, ``public``); no other file is opened.
        since: unix seconds; older uses (and files written before it) are left out.
        exclude_node: leave this node's records out (a node asking what the others served).
        max_file_bytes: the largest file read (``fleet_memory.max_file_bytes``).
        now: the reader's clock (default ``time.time()``): a file written later than
            :data:`MAX_SKEW_S` past it is invalid.

    Raises:
        ValueError: a namespace that is not a valid tenant name.
    """
    wanted = list(dict.fromkeys(check_tenant_name(ns) for ns in namespaces))
    t = time.time() if now is None else now
    merged: dict[str, Use] = {}
    for ns in wanted:
        for meta, holders in _listed(tiers, f"fleet/{ns}/", stats).items():
            node = meta[len(f"fleet/{ns}/"): -len(".json")]
            if node == exclude_node:
                continue
            found = read_file(holders, meta, ns, stats, max_bytes=max_file_bytes, now=t)
            if found is None or found.written_at < since:
                continue
            for key, at, uses, tr in found.entries(release=True):
                if at < since:
                    continue
                name = f"{ns}/{key[:2]}/{key}{SUFFIX}"  # object_name's, of a checked key
                age = found.traffic - tr
                m = merged.get(name)
                if m is None:
                    merged[name] = Use(name, at, uses, tr, node, age)
                elif at > m.at:
                    merged[name] = Use(name, at, m.uses + uses, tr, node, min(m.traffic_age, age))
                else:
                    merged[name] = replace(m, uses=m.uses + uses, traffic_age=min(m.traffic_age, age))
    out = list(merged.values())
    del merged
    # by (-at, -uses), in two stable passes whose keys are the Uses' own values (no tuple per name);
    # equal keys keep their order: a request's blocks stay in chain order
    out.sort(key=attrgetter("uses"), reverse=True)
    out.sort(key=attrgetter("at"), reverse=True)
    return out


def check_fleet_files(tier: Tier, *, max_file_bytes: int = MAX_FILE_BYTES,
                      now: float | None = None) -> Iterator[tuple[str, str]]:
    """Every fleet file of every namespace in ``tier`` that a reader would skip, with why: for
    ``prefill store verify``. Yields ``(metadata name, reason)``; a file under ``fleet/`` whose
    name is not ``fleet/<namespace>/<node_id>.json`` is one too.

    Raises:
        StoreUnavailable: the tier cannot be listed (``list_meta``); a file that cannot be read
            is yielded with the error as its reason.
    """
    t = time.time() if now is None else now
    for meta in tier.list_meta("fleet/"):
        ns, _, file = meta[len("fleet/"):].partition("/")
        node = file[: -len(".json")] if file.endswith(".json") else ""
        try:
            check_tenant_name(ns)
            check_node_id(node)
        except ValueError as exc:
            yield meta, f"not a fleet file name: {exc}"
            continue
        try:
            raw = tier.get_meta_capped(meta, max_file_bytes)
            if raw is None:
                continue  # removed since it was listed
            text = _text(raw, meta)
            del raw
            decode(text, ns, node, now=t)
        except StoreRecordInvalid as exc:
            yield meta, str(exc)
        except TIER_ERRORS as exc:
            yield meta, f"unreadable: {exc}"


def _listed(tiers: Sequence[Tier], prefix: str, stats: StoreStats | None) -> dict[str, list[Tier]]:
    """Fleet files under ``prefix`` (one per node: ``<prefix><node>.json``), each with the tiers
    that list it, fastest first."""
    found: dict[str, list[Tier]] = {}
    for tier in tiers:
        try:
            names = tier.list_meta(prefix)
        except TIER_ERRORS as exc:
            _tier_failed(stats, f"cannot list {prefix}", tier, exc)
            continue
        for name in names:
            node = name[len(prefix):]
            if node.endswith(".json") and "/" not in node and NODE_ID.fullmatch(node[: -len(".json")]):
                found.setdefault(name, []).append(tier)
    return dict(sorted(found.items()))
