"""Shared setup of the upload tests: a node tier, a remote tier in a directory, and the uploads
between them; and a child process that drains a backlog into a remote that never answers.

Run as ``python -m tests.store.engines.vllm.upload_setup <nvme dir> <far dir> <blocks>`` (from the
repository root), the child writes ``blocks`` snapshots to NVMe, enqueues them, prints
``inflight`` once two uploads are stuck in flight, and waits to be killed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

from store.engines.vllm.stats import Counters
from store.engines.vllm.uploads import Uploads
from store.format.encode import EncodedSnapshot
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.far_tier import FarDir
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

CREDENTIALS = {"acme": ACME}
ROOT = make_root()


def snapshots(n: int, *, start: int = 0, **kw) -> list[EncodedSnapshot]:
    """``n`` of acme's snapshots, each of its own chain (any order can be uploaded)."""
    return [make_snapshot(ROOT, make_chain(ROOT, 1, start=1000 * (start + i))[0], seed=start + i, **kw)
            for i in range(n)]


def name_of(snap: EncodedSnapshot) -> str:
    return object_name("acme", snap.key)


def uploads(local: LocalTier, remote: Store, *, streams: int = 1, max_bytes: int = 1 << 30,
            backoff_s: float = 3600.0, clock: Callable[[], float] = time.time, **kw) -> Uploads:
    return Uploads(remote, local, streams=streams, max_bytes=max_bytes, backoff_s=backoff_s, counters=Counters(),
                   credentials=CREDENTIALS.__getitem__, tenants={"acme"}, clock=clock, **kw)


def write(local: LocalTier, up: Uploads, snap: EncodedSnapshot) -> str:
    """Put ``snap`` on NVMe and enqueue it, as the writer does; its object name."""
    assert Store([local]).put(ACME, snap)
    assert up.put(ACME, snap)
    return name_of(snap)


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_S  # a hang guard, not a measure of speed
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


def _child(nvme: Path, far_dir: Path, blocks: int) -> None:
    local, far = LocalTier(nvme, cap_bytes=64 << 20), FarDir(far_dir)
    far.held.clear()  # S3 never answers: the uploads hang in flight until the process is killed
    up = uploads(local, Store([far]), streams=2)
    for snap in snapshots(blocks):
        write(local, up, snap)
    wait_for(lambda: far.inflight == 2, "two uploads in flight")
    print("inflight", flush=True)
    time.sleep(HANG_S)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
