"""A ``KVLoader``'s use of the machine's node process, and its own way when there is none.

With a node (:class:`store.node.client.NodeClient`), a loader asks it which leading blocks the
node tier holds (one local round trip), hands it the copies from S3 of what the node tier
lacks, and tells it what each request used (fleet memory): one process per machine does that
work for every engine. Each call takes the loader's own way (its store probe, its fetcher, its
recorder) when no node answers: a notebook or a test with no node works as before, and a node
that dies mid-run costs nothing but its help until the client has reconnected.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from store.errors import NodeRefused, NodeUnavailable
from store.identity.keys import Block
from store.serving.fetch import Scope

if TYPE_CHECKING:
    from store.config import KvwarmConfig
    from store.node.client import NodeClient

log = logging.getLogger("kvwarm.loader")
_AWAY = (NodeUnavailable, NodeRefused)


class NodeLink:
    """The loader's node, or none.

    Args:
        client: a connected client, or ``None`` (the loader works alone).
    """

    def __init__(self, client: "NodeClient | None" = None) -> None:
        self.client = client
        self.fallbacks = 0  # calls that took the loader's own way because the node was away

    @classmethod
    def open(cls, node: "NodeClient | Literal['auto'] | None", config: "KvwarmConfig", store_url: str) -> "NodeLink":
        """``node`` as given; ``"auto"``: the node at ``node.socket`` when one answers now (none is
        started: a loader alone is a notebook's or a test's); ``None``: none."""
        if node != "auto":
            return cls(node)  # type: ignore[arg-type]
        from store.node.client import NodeClient

        client = NodeClient(config, store_url, autostart=False)
        try:
            client.connect()
        except _AWAY as exc:
            log.info("kvwarm loader: working without a node process (%s)", exc)
            client.close()
            return cls(None)
        return cls(client)

    def probe(self, scope: Scope, blocks: Sequence[Block], alone: Callable[[], int]) -> int:
        """Leading ``blocks`` the node tier holds: the node's answer, else ``alone()``."""
        if self.client is not None:
            try:
                return self.client.lookup(scope.ns, [b.key for b in blocks]).count
            except _AWAY as exc:
                self._away(exc)
        return alone()

    def fetch(self, scope: Scope, blocks: Sequence[Block], alone: Callable[[Scope, Sequence[Block]], None]) -> None:
        """Have ``blocks`` copied from S3 into the node tier: by the node, else by ``alone``."""
        if self.client is not None:
            try:
                self.client.prefetch(scope.ns, [b.key for b in blocks])
                return
            except _AWAY as exc:
                self._away(exc)
        alone(scope, blocks)

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
