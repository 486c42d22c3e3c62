"""``prefill`` that stops dead after a set number of snapshot writes, for the kill-and-rerun test.

``python -m tests.prefill.paused_warm MARKER N ARGS...`` runs ``prefill ARGS...`` with
:meth:`store.tiers.store.Store.put` gated: once ``N`` puts have written a snapshot,
``MARKER`` is created and every later put waits forever. A parent that waits for the
marker and then SIGKILLs the job kills one that is certainly mid-run, with exactly ``N``
snapshots written, whatever the machine's speed.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from prefill.cli import main
from store.tiers.store import Store


def pause_after(n: int, marker: Path) -> None:
    """Gate ``Store.put`` in this process: ``n`` writes go through, then every put blocks."""
    real_put = Store.put
    gate = threading.Condition()
    left = [n]  # writes still allowed, counting those in flight
    written = [0]

    def put(self, tenant, snap):  # type: ignore[no-untyped-def]
        with gate:
            while left[0] == 0:
                gate.wait()  # after the n-th write: until the parent kills the job
            left[0] -= 1
        wrote = False
        try:
            wrote = real_put(self, tenant, snap)
            return wrote
        finally:
            with gate:
                if not wrote:  # skipped (already stored) or failed: no file, the slot goes back
                    left[0] += 1
                    gate.notify()
                else:
                    written[0] += 1
                    if written[0] == n:
                        marker.touch()

    Store.put = put  # type: ignore[method-assign]


if __name__ == "__main__":
    pause_after(int(sys.argv[2]), Path(sys.argv[1]))
    sys.exit(main(sys.argv[3:]))
