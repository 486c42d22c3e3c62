"""The kvwarm node process: one per machine, shared by every engine on it (docs/guides/node.md).

:class:`NodeClient` is what an engine keeps (:mod:`store.node.client`); ``prefill node`` runs the
process (:mod:`store.node.cli`, :class:`store.node.service.NodeService` behind
:class:`store.node.server.NodeServer`); :mod:`store.node.protocol` is what crosses between them, and :mod:`store.node.ring` the bounded
shared-memory ring through which an engine hands write-back blocks to the node.
"""
from store.node.client import NodeClient, NodeLookup
from store.node.handshake import Handshake, socket_path

__all__ = ["Handshake", "NodeClient", "NodeLookup", "socket_path"]
