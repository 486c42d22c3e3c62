"""An engine process for the crash tests: hands a step's saves to the node through its ring, then
reserves one more slot, half fills it, says ``ready`` and waits to be killed.

    python -m tests.store.node.ring_engine CONFIG_JSON RING_DIR
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from store.config import parse_config
from store.format.precision import Precision
from tests.store.node.ring_saves_setup import caches, ring_writer, saves


def main() -> int:
    config = parse_config(json.loads(Path(sys.argv[1]).read_text()))
    lay, kv = caches()
    writer = ring_writer(config.store.url.removeprefix("file://"), config, lay, Precision(), sys.argv[2])
    handoff = writer.handoff
    assert handoff is not None and handoff.client.wait_connected(60)
    assert writer.copy_out_step(saves(), kv) == [None, None]
    while writer.queued_bytes:
        time.sleep(0.01)
    slot = handoff.writer.reserve(*handoff.sizes)  # a block being written when the engine dies
    assert slot is not None
    slot.write(0, b"\x01\x00\x00\x00")
    print(json.dumps({"ready": True, "ring": handoff.ring.path,
                      "handed": handoff.counters.totals().get("write_back_handed", 0)}), flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
