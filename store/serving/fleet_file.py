"""Fleet files: one node's record of one namespace, ``fleet/<namespace>/<node_id>.json`` in a
tier's metadata area, and :func:`read_fleet`, which merges every node's records.

The format (docs/reference/fleet.md): one JSON object, columns newest first, ages relative to
``written_at``. A reader opens only the namespaces it is given; a file that does not parse, or
that names another namespace or node than its path, is skipped and counted, never raised.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

from store.config_sections import NODE_ID
from store.errors import StoreError
from store.identity.tenant import check_tenant_name
from store.tiers.base import SUFFIX, Tier
from store.tiers.stats import StoreStats

log = logging.getLogger("kvwarm.fleet")

#: the ``format`` of a fleet file; a reader skips (and counts) any other
FORMAT = "kvwarm-fleet/1"
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


@dataclass(frozen=True)
class Use:
    """What the fleet recorded of one block.

    Attributes:
        name: the block's tier object name (``<namespace>/<kk>/<key>.kvw``, salted).
        at: unix seconds of its last use (by any node).
        uses: how many requests used it (summed over nodes), counted since it entered a
            node's record (it leaves after ``window_s`` unused).
        traffic: the request counter of the node that used it last, at that use.
        node: the node that used it last.
        traffic_age: requests served since its last use, by the node where that count is
            smallest (measured when each node last wrote its record): its age in traffic.
    """

    name: str
    at: float
    uses: int
    traffic: int
    node: str
    traffic_age: int = 0


def encode(ns: str, node: str, t: float, counter: int, window_s: float,
           items: Sequence[tuple[str, Entry]]) -> bytes:
    """A fleet file (docs/reference/fleet.md): columns, newest first, ages relative to ``written_at``."""
    doc = {
        "format": FORMAT, "namespace": ns, "node": node, "written_at": t, "traffic": counter, "window_s": window_s,
        "keys": [k for k, _ in items],
        "age_s": [round(t - e[0], 3) for _, e in items],
        "uses": [e[1] for _, e in items],
        "traffic_age": [counter - e[2] for _, e in items],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class FleetFile:
    """One node's record of one namespace, as read back."""

    node: str
    written_at: float
    traffic: int
    entries: tuple[tuple[str, float, int, int], ...]  # (key, at, uses, traffic at last use), newest first


def _decode(raw: bytes, ns: str, node: str) -> FleetFile:
    """Parse and check a fleet file of ``node`` for ``ns``; raises ``ValueError`` for anything else."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    if doc.get("namespace") != ns or doc.get("node") != node:
        raise ValueError(f"it names namespace {doc.get('namespace')!r} and node {doc.get('node')!r}")
    t, counter = doc.get("written_at"), doc.get("traffic")
    if not isinstance(t, (int, float)) or not isinstance(counter, int):
        raise ValueError("written_at or traffic is missing")
    cols = [doc.get(c) for c in ("keys", "age_s", "uses", "traffic_age")]
    if not all(isinstance(c, list) for c in cols) or len({len(c) for c in cols}) != 1:
        raise ValueError("its columns are missing or of different lengths")
    entries = []
    for key, age, uses, tage in zip(*cols):
        if not (isinstance(key, str) and _KEY.fullmatch(key) and isinstance(age, (int, float))
                and isinstance(uses, int) and isinstance(tage, int)) or uses < 1:
            raise ValueError(f"bad entry {key!r}")
        entries.append((key, float(t) - age, uses, counter - tage))
    return FleetFile(node, float(t), counter, tuple(entries))


def _tier_failed(stats: StoreStats | None, what: str, tier: Tier, exc: BaseException) -> None:
    """A tier that did not answer: logged and counted (``tier_failures``), never raised."""
    log.warning("fleet memory: %s in the %s tier: %s", what, tier.kind, exc)
    if stats is not None:
        stats.incr("tier_failures")


def read_file(tiers: Sequence[Tier], meta: str, ns: str, stats: StoreStats | None) -> FleetFile | None:
    """``meta`` from the fastest tier that has a whole copy; ``None`` when none has (corrupt copies counted)."""
    node = meta.rsplit("/", 1)[-1][: -len(".json")]
    for tier in tiers:
        try:
            raw = tier.get_meta(meta)
        except TIER_ERRORS as exc:
            _tier_failed(stats, f"{meta} unreadable", tier, exc)
            continue
        if raw is None:
            continue
        try:
            return _decode(raw, ns, node)
        except ValueError as exc:  # another tier's copy may be whole
            log.warning("fleet memory: skipped %s (corrupt: %s)", tier.describe(meta), exc)
            if stats is not None:
                stats.incr("corrupt")
    return None


def read_fleet(tiers: Sequence[Tier], namespaces: Sequence[str], *, since: float,
               exclude_node: str | None = None, stats: StoreStats | None = None) -> list[Use]:
    """Every node's records of ``namespaces`` used at or after ``since``, merged per name, newest first
    (ties: most used first, then in the order of the request that used them: a chain's head first).

    Per name: the latest ``at`` (and its node and counter), the summed ``uses``, the smallest
    ``traffic_age`` over the nodes that used it. Each node's file is read from the fastest tier
    that lists it (a node's own local tier holds only what that host wrote; a shared tier holds
    the fleet's). Never raises for store trouble: a tier that fails is skipped and a corrupt file
    is skipped with a warning, each counted in ``stats`` (``tier_failures``, ``corrupt``).

    Args:
        namespaces: the namespaces the caller may see (its own tenant's, ``public``); no other file is opened.
        since: unix seconds; older uses are left out.
        exclude_node: leave this node's records out (a node asking what the others served).

    Raises:
        ValueError: a namespace that is not a valid tenant name.
    """
    wanted = list(dict.fromkeys(check_tenant_name(ns) for ns in namespaces))
    merged: dict[str, list[Any]] = {}  # name -> [at, uses, traffic, node, traffic_age]
    for ns in wanted:
        for meta, holders in _listed(tiers, f"fleet/{ns}/", stats).items():
            node = meta[len(f"fleet/{ns}/"): -len(".json")]
            if node == exclude_node:
                continue
            found = read_file(holders, meta, ns, stats)
            if found is None or found.written_at < since:
                continue
            for key, at, uses, tr in found.entries:
                if at < since:
                    break  # newest first
                name = f"{ns}/{key[:2]}/{key}{SUFFIX}"  # object_name's, of a checked key
                age = found.traffic - tr
                m = merged.get(name)
                if m is None:
                    merged[name] = [at, uses, tr, node, age]
                    continue
                if at > m[0]:
                    m[0], m[2], m[3] = at, tr, node
                m[1] += uses
                m[4] = min(m[4], age)
    uses = [Use(name, at, n, tr, node, age) for name, (at, n, tr, node, age) in merged.items()]
    uses.sort(key=lambda u: (-u.at, -u.uses))  # stable: a request's blocks stay in chain order
    return uses


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

