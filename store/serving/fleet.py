"""Fleet memory: which blocks each serving node served, and when, for nodes that start later.

A :class:`FleetRecorder` lives in a serving process. The engine calls :meth:`FleetRecorder.record`
once per served request with the tier object names of the request's full blocks (salted names:
never prompts or token ids); it is an in-memory update under a lock, bounded per namespace
(least recently used names dropped). Every ``flush_s`` the recorder writes, per namespace, one
file ``fleet/<namespace>/<node_id>.json`` into every tier's metadata area (atomically:
:meth:`store.tiers.base.Tier.put_meta`), best effort. :func:`read_fleet` merges every node's
records for the namespaces a caller may see; a new or replaced node warms from them, and the
planner reads them. The file format and its costs: docs/reference/fleet.md
(:mod:`store.serving.fleet_file`).

A namespace is a tenant's namespace (the first part of an object name): one file per namespace
and node, so a reader asks only for the namespaces it is allowed and never opens another's. Each
namespace has its own request counter: a namespace's file counts only the requests that used its
blocks, so it says nothing of another tenant's volume.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

from store.config_sections import FleetMemoryConfig
from store.errors import ConfigError
from store.identity.tenant import check_tenant_name
from store.serving.fleet_file import (
    TIER_ERRORS,
    Entry,
    MAX_FILE_BYTES,
    FleetFile,
    Use,
    check_node_id,
    encode_capped,
    fleet_file,
    read_file,
    read_fleet,
)
from store.tiers.base import SUFFIX, Tier, parse_object_name
from store.tiers.stats import StoreStats

__all__ = ["NODE_ID_ENV", "FleetRecorder", "Use", "read_fleet", "resolve_node_id"]

log = logging.getLogger("kvwarm.fleet")

#: environment variable naming this node when neither the caller nor the config does
NODE_ID_ENV = "KVWARM_NODE_ID"
_KEYED = 3 + 64 + len(SUFFIX)  # "<kk>/<key>.kvw"


def resolve_node_id(given: str | None = None, configured: str | None = None,
                    environ: Mapping[str, str] | None = None) -> str:
    """This node's id: ``given`` (a keyword), else ``$KVWARM_NODE_ID``, else ``configured``
    (``fleet_memory.node_id``), else the host name (stable across restarts of the engine).

    Raises:
        ConfigError: the id found is not a valid node id (the message names where it came from).
    """
    env = os.environ if environ is None else environ
    for value, where in ((given, "node_id"), (env.get(NODE_ID_ENV) or None, f"${NODE_ID_ENV}"),
                         (configured, "fleet_memory.node_id"), (socket.gethostname(), "the host name")):
        if value is None:
            continue
        try:
            return check_node_id(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}; set {NODE_ID_ENV} or fleet_memory.node_id") from None
    raise AssertionError("unreachable: the host name is always there")


class FleetRecorder:
    """Records the blocks a serving node serves, and writes them to the tiers every ``flush_s``.

    Args:
        tiers: where the records go (every tier's metadata area).
        node_id: this node's stable name (see :func:`resolve_node_id`).
        window_s: a name unused for this long is dropped at the next flush.
        flush_s: :meth:`maybe_flush` writes when this long has passed since the last write.
        max_names: most names kept per namespace; past it the least recently used are dropped.
        max_file_bytes: largest file written or read back; a namespace's least recently used
            names are left out of its file to stay under it.
        clock: time source.

    Raises:
        ValueError: a bad node id, or a window, interval or bound that is not positive.

    The counters in :attr:`stats`: ``requests``, ``dropped`` (over ``max_names``, or left out of
    a file over ``max_file_bytes``), ``expired``, ``files_written``, ``tier_failures``,
    ``resumed`` (names taken over from this node's previous record), ``corrupt``.
    """

    def __init__(self, tiers: Sequence[Tier], node_id: str, *, window_s: float = 3600.0, flush_s: float = 30.0,
                 max_names: int = FleetMemoryConfig.model_fields["max_names"].default,
                 max_file_bytes: int = MAX_FILE_BYTES, clock: Callable[[], float] = time.time) -> None:
        if not window_s > 0 or not flush_s > 0:
            raise ValueError(f"window_s and flush_s must be positive, got {window_s!r} and {flush_s!r}")
        if not isinstance(max_names, int) or max_names < 1:
            raise ValueError(f"max_names must be a positive integer, got {max_names!r}")
        if not isinstance(max_file_bytes, int) or max_file_bytes < 1024:
            raise ValueError(f"max_file_bytes must be an integer of at least 1024, got {max_file_bytes!r}")
        self.tiers = list(tiers)
        self.node_id = check_node_id(node_id)
        self.window_s = float(window_s)
        self.flush_s = float(flush_s)
        self.max_names = max_names
        self.max_file_bytes = max_file_bytes
        self.clock = clock
        self.stats = StoreStats()
        self._lock = threading.Lock()  # guards the names and the counters (record's lock: held briefly)
        self._flush_lock = threading.Lock()  # one flush at a time
        self._names: dict[str, OrderedDict[str, Entry]] = {}  # namespace -> key -> entry, least recent first
        self._dirty: set[str] = set()  # namespaces changed since they were last written
        self._traffic: dict[str, int] = {}  # namespace -> requests that used its blocks (its own counter)
        self._resumed: set[str] = set()
        self._last_flush = clock()
        self._flushing: cf.Future[int] | None = None  # a flush handed to an executor, not yet done
        self._known: set[str] = set()  # namespaces whose names were checked

    @classmethod
    def from_config(cls, tiers: Sequence[Tier], config: FleetMemoryConfig, *, node_id: str | None = None,
                    clock: Callable[[], float] = time.time) -> "FleetRecorder":
        """A recorder as the config's ``fleet_memory`` section says (node id as :func:`resolve_node_id`)."""
        return cls(tiers, resolve_node_id(node_id, config.node_id), window_s=config.window_s,
                   flush_s=config.flush_s, max_names=config.max_names, max_file_bytes=config.max_file_bytes,
                   clock=clock)

    # -- the serving path ----------------------------------------------------
    def record(self, names: Sequence[str], now: float | None = None) -> None:
        """One served request used the blocks ``names`` (tier object names): one unit of traffic in
        each namespace it used (a namespace counts only the requests that used its blocks; a name
        listed twice counts once).

        In memory only, thread-safe. Raises ``ValueError`` for a name that is not an object name.
        """
        t = self.clock() if now is None else float(now)
        parsed = [self._split(n) for n in names]
        dropped = 0
        with self._lock:
            counters: dict[str, int] = {}  # this request's count in each namespace it used
            # the chain's head goes in last, as the most recent: it is listed first and dropped last
            for ns, key in reversed(parsed):
                c = counters.get(ns)
                if c is None:
                    c = counters[ns] = self._traffic[ns] = self._traffic.get(ns, 0) + 1
                d = self._names.get(ns)
                if d is None:
                    d = self._names[ns] = OrderedDict()
                old = d.get(key)
                if old is None:
                    d[key] = (t, 1, c)
                    if len(d) > self.max_names:
                        d.popitem(last=False)
                        dropped += 1
                elif old[2] != c:  # the same count: this request listed it already
                    d[key] = (t, old[1] + 1, c)
                    d.move_to_end(key)
                self._dirty.add(ns)
        self.stats.incr("requests")
        if dropped:
            self.stats.incr("dropped", dropped)

    def _split(self, name: str) -> tuple[str, str]:
        """``(namespace, key)`` of an object name: its shape checked cheaply, each namespace once."""
        ns, _, rest = name.partition("/") if isinstance(name, str) else ("", "", "")
        if len(rest) != _KEYED or rest[2] != "/" or not rest.endswith(SUFFIX) or rest[:2] != rest[3:5]:
            parse_object_name(name)  # raises with the message of record
            raise ValueError(f"not a snapshot object name: {name!r}")
        if ns not in self._known:
            check_tenant_name(ns)
            self._known.add(ns)
        return ns, rest[3:-len(SUFFIX)]

    def due(self, now: float | None = None) -> bool:
        """Whether :meth:`maybe_flush` would write now (cheap: for a caller that flushes elsewhere)."""
        return (self.clock() if now is None else now) - self._last_flush >= self.flush_s

    def maybe_flush(self, now: float | None = None) -> int:
        """:meth:`flush` if ``flush_s`` has passed since the last one; returns the files written."""
        t = self.clock() if now is None else now
        return self.flush(t) if self.due(t) else 0

    def flush_when_due(self, executor: cf.Executor) -> None:
        """Hand :meth:`maybe_flush` to ``executor`` when a flush is due and none is in flight (the
        serving path's call after :meth:`record`: it never writes on the caller's thread)."""
        if self.due() and (self._flushing is None or self._flushing.done()):
            self._flushing = executor.submit(self.maybe_flush)

    # -- writing -------------------------------------------------------------
    def flush(self, now: float | None = None) -> int:
        """Write each namespace whose record changed (or lost names to the window) to every tier.

        Best effort: a tier that fails is logged and counted (``tier_failures``), never raised;
        a namespace no tier took is written again at the next flush. Returns the files written.
        """
        t = self.clock() if now is None else now
        with self._flush_lock:
            self._last_flush = t
            self._resume(t)
            with self._lock:
                todo = self._expire(t)
                counters = {ns: self._traffic.get(ns, 0) for ns in todo}
            written = 0
            for ns, items in todo.items():
                data, left_out = encode_capped(ns, self.node_id, t, counters[ns], self.window_s, items,
                                               self.max_file_bytes)
                if left_out:
                    self.stats.incr("dropped", left_out)
                    log.warning("fleet memory: %d of %s's oldest names left out of its file to keep it under "
                                "fleet_memory.max_file_bytes (%d)", left_out, ns, self.max_file_bytes)
                if self._put(fleet_file(ns, self.node_id), data):
                    written += 1
                else:
                    with self._lock:
                        self._dirty.add(ns)
            return written

    def _expire(self, t: float) -> dict[str, list[tuple[str, Entry]]]:
        """Under the lock: drop names unused since ``t - window_s``; the namespaces to write, newest first."""
        cutoff, todo, expired = t - self.window_s, {}, 0
        for ns, d in self._names.items():
            gone = 0
            while d:
                key = next(iter(d))
                if d[key][0] >= cutoff:
                    break
                del d[key]
                gone += 1
            expired += gone
            if gone or ns in self._dirty:
                # newest first; a name recorded with an older ``now`` than its neighbours is filtered here
                todo[ns] = [(k, e) for k, e in reversed(d.items()) if e[0] >= cutoff]
        self._dirty.clear()
        if expired:
            self.stats.incr("expired", expired)
        return todo

    def _put(self, meta: str, data: bytes) -> bool:
        ok = False
        for tier in self.tiers:
            try:
                tier.put_meta(meta, data)
                ok = True
            except TIER_ERRORS as exc:
                self.stats.incr("tier_failures")
                log.warning("fleet memory: %s not written to the %s tier: %s", meta, tier.kind, exc)
        if ok:
            self.stats.incr("files_written")
        return ok

    def _resume(self, t: float) -> None:
        """Before a namespace is first written: take over this node's previous record of it
        (an engine restarted on the same node), so that a restart does not erase it."""
        with self._lock:
            pending = [ns for ns in self._names if ns not in self._resumed]
        if not pending:
            return
        previous: dict[str, FleetFile] = {}
        for ns in pending:
            found = read_file(self.tiers, fleet_file(ns, self.node_id), ns, self.stats,
                              max_bytes=self.max_file_bytes, now=max(t, self.clock()))
            if found is not None:
                previous[ns] = found
        cutoff = t - self.window_s
        with self._lock:
            for ns in pending:
                self._resumed.add(ns)
                if ns not in previous:
                    continue
                # the namespace's counter continues its previous record's: shift what was recorded since the start
                base = previous[ns].traffic
                self._traffic[ns] = self._traffic.get(ns, 0) + base
                d = self._names[ns]
                for key, (at, uses, tr) in d.items():
                    d[key] = (at, uses, tr + base)
                self.stats.incr("resumed", self._take_over(d, previous[ns], cutoff, base))
                self._dirty.add(ns)

    def _take_over(self, d: OrderedDict[str, Entry], old: FleetFile, cutoff: float, base: int) -> int:
        """Merge a previous record into ``d`` (under the lock); its names are older than all of ``d``'s."""
        taken = 0
        for key, at, uses, tr in old.entries():  # newest first: each goes in front of the last
            if at < cutoff:
                continue
            cur = d.get(key)
            if cur is not None:
                d[key] = (cur[0], cur[1] + uses, cur[2])
            elif len(d) < self.max_names:
                d[key] = (at, uses, min(tr, base))
                d.move_to_end(key, last=False)
                taken += 1
        return taken

    def close(self) -> None:
        """Write what is pending (best effort, as :meth:`flush`)."""
        self.flush()


