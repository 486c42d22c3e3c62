"""A ``KVLoader``'s use of the machine's node process, and its own way when there is none.

With a node (:class:`store.node.client.NodeClient`), a loader asks it which leading blocks the
node tier holds (one local round trip), hands it the copies from S3 of what the node tier
lacks (a lookup's miss, and a prefetch's chains: :meth:`NodeLink.hand`, then
:meth:`NodeLink.pending` until the node has copied them), and tells it what each request used
(fleet memory): one process per machine does that work for every engine, and no S3 GET is made
in the loader's process while the node answers. Each call takes the loader's own way (its store probe, its fetcher, its
recorder) when no node answers: a notebook or a test with no node works as before, and a node
that dies mid-run costs nothing but its help until the client has reconnected.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from store.errors import NodeRefused, NodeUnavailable
from store.identity.keys import Block, BlockKey
from store.serving.fetch import Scope

if TYPE_CHECKING:
    from store.config import KvwarmConfig
    from store.node.client import NodeClient

log = logging.getLogger("kvwarm.loader")
_AWAY = (NodeUnavailable, NodeRefused)
#: how long after a link to a node still connecting its first hand-offs wait for it (an engine's
#: agents start with its workers, before the scheduler has started the node)
SETTLE_S = 20.0


def _keys(blocks: Sequence[Block | BlockKey]) -> list[str]:
    return [b if isinstance(b, str) else b.key for b in blocks]


class NodeLink:
    """The loader's node, or none.

    Args:
        client: a client (connected, or connecting in the background), or ``None`` (the loader works alone).
        settle_s: a client still connecting: :meth:`hand` waits for it until this long after the link
            is made (a prefetch's streams wait, never a lookup).
    """

    def __init__(self, client: "NodeClient | None" = None, *, settle_s: float = 0.0) -> None:
        self.client = client
        self.fallbacks = 0  # calls that took the loader's own way because the node was away
        self._settled = time.monotonic() + settle_s

    @classmethod
    def open(cls, node: "NodeClient | Literal['auto'] | None", config: "KvwarmConfig", store_url: str) -> "NodeLink":
        """``node`` as given (one still connecting: for up to :data:`SETTLE_S`, 2 s with ``node.autostart``
        off); ``"auto"``: the node at ``node.socket`` when one answers now (none is started: a loader
        alone is a notebook's or a test's); ``None``: none."""
        if node != "auto":  # a client still connecting is waited for by the first prefetches
            settle = SETTLE_S if config.node.autostart else 2.0
            return cls(node, settle_s=settle if node is not None and not node.connected else 0.0)
        from store.node.client import NodeClient

        client = NodeClient(config, store_url, autostart=False)
        try:
            client.connect()
        except _AWAY as exc:
            log.info("kvwarm loader: working without a node process (%s)", exc)
            client.close()
            return cls(None)
        return cls(client)

    def probe(self, scope: Scope, blocks: Sequence[Block | BlockKey], alone: Callable[[], int]) -> int:
        """Leading ``blocks`` (or bare keys) the node tier holds: the node's answer, else ``alone()``."""
        if self.client is not None:
            try:
                return self.client.lookup(scope.ns, _keys(blocks)).count
            except _AWAY as exc:
                self._away(exc)
        return alone()

    def fetch(self, scope: Scope, blocks: Sequence[Block], alone: Callable[[Scope, Sequence[Block]], None]) -> None:
        """Have ``blocks`` copied from S3 into the node tier: by the node, else by ``alone``."""
        if self.client is not None:
            try:
                self.client.prefetch(scope.ns, _keys(blocks))
                return
            except _AWAY as exc:
                self._away(exc)
        alone(scope, blocks)

    def hand(self, scope: Scope, blocks: Sequence[Block | BlockKey]) -> bool:
        """Hand the copies of ``blocks`` (a chain's rest, in prefix order) to the node; ``False``:
        no node took them (the caller copies alone). Waits for a client still connecting, within
        ``settle_s`` of the link's making."""
        if self.client is None:
            return False
        left = self._settled - time.monotonic()
        if left > 0 and not self.client.connected:
            self.client.wait_connected(left)
        try:
            self.client.prefetch(scope.ns, _keys(blocks))
        except _AWAY as exc:
            self._away(exc)
            return False
        return True

    def pending(self, scope: Scope, blocks: Sequence[Block | BlockKey]) -> int | None:
        """How many of ``blocks`` the node still has to copy (0: done, for now); ``None``: the node is away."""
        if self.client is None:
            return None
        try:
            return self.client.pending(scope.ns, _keys(blocks))
        except _AWAY as exc:
            self._away(exc)
            return None

    def record(self, scope: Scope, blocks: Sequence[Block | str]) -> bool:
        """Tell the node a request used ``blocks`` (fleet memory); ``False``: no node took it."""
        if self.client is None or any(isinstance(b, str) for b in blocks):
            return False  # names may span namespaces: the loader's own recorder takes them
        try:
            self.client.record(scope.ns, [b.key for b in blocks])  # type: ignore[union-attr]
            return True
        except _AWAY as exc:
            self._away(exc)
            return False

    def _away(self, exc: Exception) -> None:
        self.fallbacks += 1
        log.debug("kvwarm loader: the node is away (%s); this call works alone", exc)

    def close(self) -> None:
        """Close the connection (the node runs on)."""
        if self.client is not None:
            self.client.close()
