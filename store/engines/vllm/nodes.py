"""The connector's link to the machine's kvwarm node process (docs/guides/node.md).

The scheduler role keeps one :class:`store.node.client.NodeClient` and asks the node, in one
local round trip, which leading blocks of a chain the node tier holds, instead of querying the
tier's SQLite index on vLLM's scheduler thread (:class:`store.engines.vllm.probe.StoreProbe`).
The client connects on a thread of its own, so an engine never waits for the node at start-up:
when none answers at ``node.socket`` and ``node.autostart`` is on (the default) it starts one,
detached, which outlives the engine (a restarted engine finds it), and exits after
``node.autostart_idle_s`` with no engine connected. Until the node answers, and whenever it is
away (killed, restarting, refused), the probe asks the tier itself: the serving path never
fails because of the node.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from store.errors import KvwarmError

if TYPE_CHECKING:
    from store.engines.vllm.settings import ConnectorSettings
    from store.node.client import NodeClient

log = logging.getLogger("kvwarm.vllm")


def node_client(settings: "ConnectorSettings", *, autostart: bool | None = None) -> "NodeClient | None":
    """A client of the machine's node for this engine, connecting in the background; ``None`` (the
    connector works alone) when the node's settings cannot be used, with the reason logged.
    ``autostart``: overrides ``node.autostart`` (a worker's client leaves starting one to the scheduler's)."""
    from store.node.client import NodeClient

    try:
        client = NodeClient(settings.config, settings.store_url, autostart=autostart)
    except (KvwarmError, OSError, ValueError) as exc:
        log.warning("kvwarm: not using a node process (%s); the connector works alone", exc)
        return None
    client.reconnect_in_background()
    return client
