"""What the node process owns and does, behind its socket (:mod:`store.node.server`).

One :class:`NodeService` per machine owns, from the configuration file: the store's tiers (the
node tier first, the shared S3 tiers after it), the copies between them
(:class:`store.node.copier.Copier`), fleet memory (:class:`store.serving.fleet.FleetRecorder`),
the node agent (:class:`store.serving.agent.NodeAgent` over :class:`store.node.hands.StoreHands`),
the node tier's GC every ``node.gc_interval_s`` and a Prometheus endpoint. Its request methods
(:meth:`lookup`, :meth:`prefetch`, :meth:`pending`, :meth:`record`, :meth:`stats`) are what a client's frames
ask; none of them touches the network or holds a lock longer than a counter's.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import Any

from store.config import KvwarmConfig
from store.errors import ConfigError, StoreError
from store.identity.tenant import PUBLIC, Tenant
from store.node.block_record import Announcement
from store.node.copier import Copier
from store.node.hands import StoreHands
from store.node.handshake import Handshake
from store.node.metrics import NodeCollector, NodeCounters, node_registry
from store.node.protocol import Keys
from store.node.writes import NodeWrites
from store.serving.agent import AgentSettings, AgentThread, NodeAgent, StorePlans
from store.serving.fleet import FleetRecorder, resolve_node_id
from store.tiers.base import object_name
from store.tiers.maintenance import GcReport, gc
from store.tiers.registry import tiers_from_url
from store.tiers.store import Store

log = logging.getLogger("kvwarm.node")


def _tenants(config: KvwarmConfig) -> dict[str, Tenant]:
    """Credentials of the configured tenants whose secrets this process has (for sealed objects)."""
    out = {}
    for name in config.tenants:
        try:
            out[name] = config.tenant(name)
        except StoreError as exc:
            log.warning("kvwarm node: tenant %r's credentials are not available here (%s): its sealed objects "
                        "are not copied", name, exc)
    return out


class NodeService:
    """The node's state and its answers.

    Args:
        config: the kvwarm configuration (``node`` section: metrics, GC, agent).
        store_url: overrides ``store.url``.
        metrics_port: overrides ``node.metrics_port`` (``None``: the config's; ``-1``: none).
        gc_interval_s: overrides ``node.gc_interval_s``.
        agent: overrides ``node.agent``.

    Raises:
        ConfigError: the store's first tier is not a local directory (the node tier).
    """

    def __init__(self, config: KvwarmConfig, store_url: str | None = None, *, metrics_port: int | None = None,
                 gc_interval_s: float | None = None, agent: bool | None = None) -> None:
        self.config = config
        self.handshake = Handshake.of(config, store_url)
        tiers = tiers_from_url(store_url or config.store.url, config.store)
        if not tiers[0].mappable:
            raise ConfigError(f"store.url: the node needs a local directory first (file://...), got {tiers[0].url!r}")
        self.store = Store(tiers)
        self.local = tiers[0]
        self._objects = str(self.local.path("x"))[:-2]  # the directory object names are relative to
        self.counters = NodeCounters()
        self.copier = Copier(self.local, [t for t in tiers if t.remote], _tenants(config),
                             streams=config.loader.prefetch_streams)
        fm = config.fleet_memory
        self.node_id = resolve_node_id(None, fm.node_id)
        self.fleet = FleetRecorder.from_config(tiers, fm, node_id=self.node_id) if fm.enabled else None
        self.gc_interval_s = float(gc_interval_s or config.node.gc_interval_s)
        self.last_gc: GcReport | None = None
        self.clients = 0
        self._clients_lock = threading.Lock()
        self._idle_since: float | None = time.monotonic()
        self._stop = threading.Event()
        self._agent: AgentThread | None = None
        if config.node.agent if agent is None else agent:
            hands = StoreHands(tiers, self.copier, namespaces=[*config.tenants, PUBLIC], node_id=self.node_id,
                               link_bytes_per_s=config.agent.link_bytes_per_s,
                               max_file_bytes=fm.max_file_bytes)
            self._agent = AgentThread([NodeAgent(hands, StorePlans(tiers), AgentSettings.of(config))],
                                      name="kvwarm-node-agent").start()
        self._house = threading.Thread(target=self._housekeeping, name="kvwarm-node-gc", daemon=True)
        self._house.start()
        self.writes = NodeWrites(config, self.store, self.local, _tenants(config))
        self.metrics_port = self._serve_metrics(config.node.metrics_port if metrics_port is None else
                                                None if metrics_port < 0 else metrics_port)

    # -- requests --------------------------------------------------------------
    def lookup(self, req: Keys) -> list[str]:
        """The files of the leading ``req.keys`` the node tier holds (existence only: the engine's
        load checks each snapshot it maps). One ``stat`` per key up to the first missing one."""
        paths = []
        for key in req.keys:  # the names as object_name() makes them; the request's fields are checked already
            path = f"{self._objects}/{req.namespace}/{key[:2]}/{key}.kvw"
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):
                    break
            except OSError:
                break
            paths.append(path)
        self.counters.add(lookups=1, lookup_blocks=len(req.keys), lookup_hits=len(paths))
        return paths

    def prefetch(self, req: Keys) -> int:
        """Queue the chain's copy from the shared tier (behind the agent's); returns the blocks queued."""
        self.counters.incr("prefetch_hints")
        return self.copier.add([object_name(req.namespace, k) for k in req.keys])

    def pending(self, req: Keys) -> int:
        """How many of the chain's blocks the copies still have queued or in progress."""
        return self.copier.pending([object_name(req.namespace, k) for k in req.keys])

    def record(self, req: Keys) -> None:
        """One request used these blocks: fleet memory (in memory; written every ``fleet_memory.flush_s``)."""
        if self.fleet is not None:
            self.fleet.record([object_name(req.namespace, k) for k in req.keys])
        self.counters.incr("records")

    def attach(self, ann: Announcement) -> dict[str, Any]:
        """An engine's write-back ring: drain it into the node tier (:mod:`store.node.writer`)."""
        self.counters.incr("rings_attached")
        return self.writes.attach(ann)

    def connected(self, delta: int) -> None:
        """A client connected (+1) or left (-1)."""
        with self._clients_lock:
            self.clients += delta
            self._idle_since = time.monotonic() if self.clients == 0 else None

    def idle_for(self) -> float:
        """Seconds since the last client left (since start when none came); 0 while one is connected."""
        with self._clients_lock:
            since = self._idle_since
        return 0.0 if since is None else time.monotonic() - since

    def stats(self) -> dict[str, Any]:
        """The node's counters and state (JSON-able)."""
        return {"pid": os.getpid(), "version": self.handshake.version, "fingerprint": self.handshake.fingerprint,
                "node_id": self.node_id, "node_tier": self.local.url, "metrics_port": self.metrics_port,
                "clients": self.clients, **self.counters.snapshot(),
                "copies": dict(self.copier.counts), "write_back": self.writes.stats(),
                "last_gc": self.last_gc.as_dict() if self.last_gc is not None else None}

    # -- background ------------------------------------------------------------
    def gc_once(self) -> GcReport:
        """Collect the node tier's garbage now (the shared tiers are the GC flow's)."""
        report = gc(Store([self.local]), ttl_max_s=self.config.kv_cache.ttl_max_s)
        self.last_gc = report
        self.counters.incr("gc_runs")
        self.counters.incr("gc_removed", report.temp_removed + report.expired_removed + report.evicted)
        return report

    def _housekeeping(self) -> None:
        next_gc = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_gc:
                try:
                    self.gc_once()
                except Exception:  # noqa: BLE001 - the node serves on; the next round tries again
                    log.exception("kvwarm node: GC of the node tier failed")
                next_gc = time.monotonic() + self.gc_interval_s
            if self.fleet is not None:
                try:
                    self.fleet.maybe_flush()
                except Exception:  # noqa: BLE001 - best effort, as the recorder's own
                    log.exception("kvwarm node: the fleet record could not be written")
            self._stop.wait(min(1.0, max(0.05, next_gc - time.monotonic())))

    def _serve_metrics(self, port: int | None) -> int | None:
        if port is None:
            return None
        from prometheus_client import start_http_server

        collector = NodeCollector(self.counters, lambda: dict(self.copier.counts), self._gauges,
                                  {"version": self.handshake.version, "fingerprint": self.handshake.fingerprint,
                                   "node_id": self.node_id},
                                  write_back=self.writes.stats)
        try:
            self._httpd, _ = start_http_server(port, registry=node_registry(collector))
        except OSError as exc:
            log.warning("kvwarm node: no Prometheus endpoint: port %d: %s (set node.metrics_port)", port, exc)
            return None
        return int(self._httpd.server_port)

    def _gauges(self) -> dict[str, float]:
        try:
            used = float(self.local.usage())  # type: ignore[attr-defined]
        except (AttributeError, OSError, StoreError):
            used = 0.0
        return {"clients": float(self.clients), "tier_bytes": used, "copies_queued": float(self.copier.queued())}

    def close(self) -> None:
        """Stop the agent, the copies, GC and the endpoint; write fleet memory once more."""
        self._stop.set()
        if self._agent is not None:
            self._agent.close()
        self.copier.close()
        self.writes.close()
        self._house.join(5.0)
        if self.fleet is not None:
            self.fleet.close()
        httpd = getattr(self, "_httpd", None)
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        self.store.close()
