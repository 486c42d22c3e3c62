"""The engine's part of the fleet's memory: every finished request's full blocks, recorded.

The scheduler role tells :class:`EngineMemory` about each request it finishes; the names of
the request's full kvwarm blocks (its tenant's chain, plain or chat-keyed as write-back keys
it, and the ``public`` blocks it loaded) go to a :class:`store.serving.fleet.FleetRecorder`,
in memory. Both happen off the engine's loop, on one thread of this module's: a request's names
are hashed and handed there, and the recorder's files written every ``fleet_memory.flush_s``, and
once more at shutdown. A new or replaced node's
agent reads them (:mod:`store.engines.vllm.agents`). Nothing here raises into the engine.

While the machine's node process is connected (:mod:`store.engines.vllm.nodes`), the names go to
it instead (one local round trip per namespace): the node is then the machine's one writer of its
fleet files, and their JSON is encoded in the node's process, not under vLLM's GIL (50,000 names
held it for 64 ms). While the node is away the engine's own recorder takes them, as without a node.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import Any, Sequence

from store.engines.vllm.probe import StoreProbe
from store.errors import NodeRefused, NodeUnavailable
from store.engines.vllm.tracker import RequestState
from store.identity.tenant import PUBLIC
from store.serving.priority import lower_this_thread
from store.tiers.base import parse_object_name

log = logging.getLogger("kvwarm.connector")
#: finished requests waiting for the fleet thread at most; past it a request is recorded on the caller's thread
MAX_QUEUED = 256


class EngineMemory:
    """Records what an engine served (see the module docstring).

    Args:
        recorder: the node's :class:`store.serving.fleet.FleetRecorder`.
        probe: keys prompts as the scheduler's lookups do.
        node: the machine's node process (a :class:`store.node.client.NodeClient`), or ``None``.
    """

    def __init__(self, recorder: Any, probe: StoreProbe, node: Any = None) -> None:
        self.recorder = recorder
        self.probe = probe
        self.node = node
        self.node_records = 0  # requests recorded through the node
        self._writer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvwarm-fleet",
                                            initializer=lower_this_thread)
        self._last: cf.Future[None] | None = None  # the last request handed to the writer (it runs them in turn)
        self._queued = 0  # requests handed to the writer and not yet recorded
        self._count = threading.Lock()

    @classmethod
    def open(cls, settings: Any, tiers: Sequence[Any], probe: StoreProbe, node: Any = None) -> "EngineMemory | None":
        """The engine's memory when ``fleet_memory.enabled``, else ``None``."""
        cfg = settings.config.fleet_memory
        if not cfg.enabled:
            return None
        from store.serving.fleet import FleetRecorder

        return cls(FleetRecorder.from_config(tiers, cfg), probe, node)

    def _to_node(self, names: list[str]) -> bool:
        """Hand the names to the node, a round trip per namespace; ``False`` when it is away."""
        if self.node is None or not self.node.connected:
            return False
        by_ns: dict[str, list[str]] = {}
        for name in names:
            ns, key = parse_object_name(name)
            by_ns.setdefault(ns, []).append(key)
        try:
            for ns, keys in by_ns.items():
                self.node.record(ns, keys)
        except (NodeUnavailable, NodeRefused):
            return False  # a namespace the node took may count twice: fleet memory is best effort
        self.node_records += 1
        return True

    def names(self, st: RequestState) -> list[str]:
        """The object names of the request's full blocks (its chain, and the public ones it loaded)."""
        if st.tenant is None or not st.prompt:
            return []
        chat = bool(st.save_chat)
        out = self.probe.scope(st.tenant, chat).names(self.probe.chain(st.tenant, chat, st.prompt))
        hit = st.hit
        if hit is not None and hit.blocks and hit.namespace == PUBLIC and st.tenant != PUBLIC:
            public = self.probe.chain(PUBLIC, hit.chat, st.prompt)[:hit.blocks]
            out = self.probe.scope(PUBLIC, hit.chat).names(public) + out
        return out

    def served(self, st: RequestState) -> None:
        """A request finished: its blocks are recorded on this module's thread, not vLLM's (their names
        hashed, then handed to the node in a round trip, or to the recorder), and a flush started when due."""
        with self._count:
            inline = self._queued >= MAX_QUEUED  # the thread lags a burst: this one here, the queue bounded
            self._queued += not inline
        if inline:
            self._served(st, queued=False)
            return
        try:
            self._last = self._writer.submit(self._served, st)
        except RuntimeError:  # shut down: the engine is stopping
            with self._count:
                self._queued -= 1
            log.debug("kvwarm: request %s finished after the fleet's memory closed", st.req_id)

    def _served(self, st: RequestState, queued: bool = True) -> None:
        if queued:
            with self._count:
                self._queued -= 1
        try:
            names = self.names(st)
            if names and not self._to_node(names):
                self.recorder.record(names)
            if queued:
                self.recorder.maybe_flush()  # on the writer's thread already
            else:
                self.recorder.flush_when_due(self._writer)  # never a write on vLLM's thread
        except Exception:  # noqa: BLE001 - the fleet's memory is best effort
            log.exception("kvwarm: could not record request %s in the fleet's memory", st.req_id)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the requests handed so far to be recorded; whether they were."""
        last = self._last
        return last is None or not cf.wait([last], timeout=timeout_s).not_done

    def close(self) -> None:
        """Write what is recorded, then stop the writer."""
        self._writer.shutdown(wait=True)
        try:
            self.recorder.close()
        except Exception:  # noqa: BLE001 - shutting down never fails because of kvwarm
            log.exception("kvwarm: the fleet's memory could not be written at shutdown")
