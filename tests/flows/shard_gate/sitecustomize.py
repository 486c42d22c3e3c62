"""Test-only: make a prefill worker's flow run slow or stop it mid-shard, steered by files in $KVWARM_TEST_GATE.

Python imports this at start-up when its folder is on ``PYTHONPATH`` (tests/flows/test_shards_live.py
puts it there for the GPU pool's workers only). Nothing happens unless the gate folder holds:

- ``put-delay``: seconds every ``Store.put`` sleeps first (a slow device, so a deadline cuts);
- ``pause-after``: N. The first process to write claims the gate (``claimed``, created
  exclusively, at its first ``Store.put``) and stops in its (N+1)-th ``Store.put``, after writing ``paused`` with its pid and N, until the
  test kills it. The writes before were whole; none is in flight.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


def _install(gate: Path) -> None:
    delay_file, pause_file = gate / "put-delay", gate / "pause-after"
    delay = float(delay_file.read_text()) if delay_file.exists() else 0.0
    from store.tiers.store import Store

    real = Store.put
    written = [0]
    pause: list[int | None] = []  # decided at the first put: helper processes of a flow run never claim the gate

    def claim() -> int | None:
        if not pause_file.exists():
            return None
        try:
            os.close(os.open(gate / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        return int(pause_file.read_text())

    def put(self, tenant, snap, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not pause:
            pause.append(claim())
        if pause[0] is not None and written[0] >= pause[0]:
            (gate / "paused.tmp").write_text(f"{os.getpid()} {written[0]}")
            (gate / "paused.tmp").replace(gate / "paused")
            while True:
                time.sleep(1.0)
        if delay:
            time.sleep(delay)
        done = real(self, tenant, snap, *args, **kwargs)
        written[0] += 1
        return done

    Store.put = put


_gate = os.environ.get("KVWARM_TEST_GATE")
if _gate and Path(_gate).is_dir() and any((Path(_gate) / f).exists() for f in ("put-delay", "pause-after")):
    _install(Path(_gate))
