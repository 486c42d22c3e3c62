"""The uploads (store/engines/vllm/uploads.py): the upload backlog drained most valuable first, as
the link allows, with every block that cannot reach S3 counted by reason, and a backlog that
outlives its process (one killed with SIGKILL mid-drain included).

Over real tiers: NVMe in a directory, and as the remote tier a second directory whose writes can
be held, fail or refuse (tests/store/engines/vllm/far_tier.py), or SeaweedFS (marked ``s3``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from store.engines.vllm.agents import _applied
from store.serving.urgency import PlanChain, ReuseCurve, rank
from store.tiers.local import LocalTier
from store.tiers.registry import tier_class
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.far_tier import FarDir
from tests.store.engines.vllm.upload_setup import ROOT, name_of, snapshots, uploads, wait_for, write
from tests.store.factories import ACME, make_chain

REPO = Path(__file__).resolve().parents[4]


def _tiers(tmp_path: Path) -> tuple[LocalTier, FarDir]:
    return LocalTier(tmp_path / "nvme", cap_bytes=64 << 20), FarDir(tmp_path / "far")


def _stuck(local: LocalTier, far: FarDir, **kw):
    """Uploads whose one stream is stuck on a first block (the remote held): what comes next waits."""
    far.held.clear()
    up = uploads(local, Store([far]), streams=1, **kw)
    first = write(local, up, snapshots(1, start=99)[0])
    wait_for(lambda: far.inflight == 1, "the first upload in flight")
    return up, first


def test_under_a_slow_remote_the_backlog_drains_by_the_agents_ranking_then_oldest_first(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    t = [1000.0]
    up, first = _stuck(local, far, clock=lambda: t[0])
    try:
        snaps = snapshots(6)
        names = [name_of(s) for s in snaps]
        up.set_ranking("plain", {names[4]: 0.5})  # known when it is enqueued
        for s in snaps:
            t[0] += 1
            write(local, up, s)
        up.set_ranking("chat", {names[1]: 0.3, names[3]: 0.9})  # ranked while they wait
        up.set_ranking("plain", {names[5]: 0.4})  # replaces that agent's last: names[4] is unranked again
        assert up.rank_of(names[3]) == 0.9 and up.rank_of(names[4]) == 0.0
        far.held.set()
        assert up.drain(time.monotonic() + HANG_S)
        assert far.asked == [first, names[3], names[5], names[1], names[0], names[2], names[4]]
        assert up.counters.totals()["written_back_uploads"] == 7 and up.waiting() == 0
        for name in far.asked:  # S3 holds the bytes NVMe holds
            assert far.path(name).read_bytes() == local.path(name).read_bytes()
    finally:
        far.held.set()
        up.close()


def test_each_ranking_an_engine_agent_applies_reorders_the_backlog(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    up, first = _stuck(local, far)
    try:
        names = [write(local, up, s) for s in snapshots(3)]
        warm = rank([PlanChain((names[2],), expected_hits=2.0)], [], curve=ReuseCurve(), held=set(), capacity=10,
                    copy_s=0.0)
        engine_worker = SimpleNamespace(writer=SimpleNamespace(uploads=up))  # what _applied reads of the worker
        _applied(up.counters, warm, engine_worker, "agent:acme:plain")
        assert up.counters.totals()["agent_rankings"] == 1
        far.held.set()
        assert up.drain(time.monotonic() + HANG_S)
        assert far.asked == [first, names[2], names[0], names[1]]  # the plan's block first, then the oldest
    finally:
        far.held.set()
        up.close()


def test_read_back_bytes_in_flight_stay_within_the_bound(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    far.held.clear()
    up = uploads(local, Store([far]), streams=3, max_bytes=1)  # less than one snapshot: one at a time
    try:
        snaps = snapshots(4)
        for s in snaps:
            write(local, up, s)
        # one upload in flight; the other two streams hold a block each and wait for room
        wait_for(lambda: up._busy == 3 and far.inflight == 1, "every stream with a block claimed")
        assert up.queued_bytes == snaps[0].file_size
        far.held.set()
        assert up.drain(time.monotonic() + HANG_S)
        assert far.most == 1 and up.peak_bytes == max(x.file_size for x in snaps) and up.queued_bytes == 0
        assert up.counters.totals()["written_back_uploads"] == 4
    finally:
        far.held.set()
        up.close()


def test_a_block_evicted_from_nvme_before_its_turn_is_dropped_and_counted(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    up, first = _stuck(local, far)
    try:
        gone, kept = snapshots(2)
        gone_name, kept_name = write(local, up, gone), write(local, up, kept)
        assert local.delete(gone_name)  # the tier's LRU took it
        far.held.set()
        assert up.drain(time.monotonic() + HANG_S)
        totals = up.counters.totals()
        assert totals["upload_dropped:evicted"] == 1 and totals["written_back_uploads"] == 2
        assert not far.exists(gone_name) and far.exists(kept_name) and up.waiting() == 0
    finally:
        far.held.set()
        up.close()


def test_a_corrupt_nvme_copy_is_never_uploaded_but_quarantined_and_counted(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    up, first = _stuck(local, far)
    try:
        name = write(local, up, snapshots(1)[0])
        path = local.path(name)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a flipped bit in the payload
        path.write_bytes(bytes(data))
        far.held.set()
        assert up.drain(time.monotonic() + HANG_S)
        assert up.counters.totals()["upload_dropped:corrupt"] == 1 and not far.exists(name)
        assert not local.exists(name) and len(local.quarantined()) == 1
    finally:
        far.held.set()
        up.close()


def test_an_expired_block_is_dropped_and_one_s3_holds_is_not_sent_again(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    up = uploads(local, Store([far]), clock=lambda: time.time() + 120)
    try:
        short, held = snapshots(1, ttl_s=60)[0], snapshots(1, start=1)[0]
        assert Store([far]).put(ACME, held)  # already in S3 (read through from it, say)
        short_name, held_name = write(local, up, short), write(local, up, held)
        assert up.drain(time.monotonic() + HANG_S)
        totals = up.counters.totals()
        assert totals["upload_dropped:expired"] == 1 and totals["upload_present"] == 1
        assert "written_back_uploads" not in totals and not far.exists(short_name) and far.exists(held_name)
    finally:
        up.close()


def test_a_refused_upload_is_tried_again_with_back_off_then_dropped_and_counted(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    far.refuse = True
    up = uploads(local, Store([far]), backoff_s=0.0, max_attempts=3)
    try:
        name = write(local, up, snapshots(1)[0])
        assert up.drain(time.monotonic() + HANG_S)
        assert far.attempts == 3 and up.counters.totals()["upload_dropped:error"] == 1 and not far.exists(name)
    finally:
        up.close()


def test_an_unreachable_remote_rests_and_the_blocks_wait_unharmed(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    far.down = True
    up = uploads(local, Store([far]), streams=2)
    try:
        names = [write(local, up, s) for s in snapshots(3)]
        wait_for(up.resting, "the remote tier resting")
        assert not up.drain(time.monotonic() + HANG_S)  # nothing more can be sent now
        assert far.attempts <= 2 and up.waiting() == 3
        assert all(r.attempts == 0 for r in up.backlog.rows())  # an outage is not the block's fault
        assert not any(k.startswith("upload_dropped") for k in up.counters.totals())
        assert all(local.exists(n) for n in names)
    finally:
        up.close()


def test_a_backlog_left_by_a_process_killed_mid_drain_is_drained_by_the_next(tmp_path) -> None:
    nvme, far_dir = tmp_path / "nvme", tmp_path / "far"
    child = subprocess.Popen([sys.executable, "-m", "tests.store.engines.vllm.upload_setup", str(nvme), str(far_dir),
                              "5"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "inflight"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(HANG_S)
    local, far = _tiers(tmp_path)
    assert not any(far.entries())  # the killed uploads left nothing in S3
    up = uploads(local, Store([far]), streams=2)
    try:
        assert up.backlog.resumed == 5
        assert up.drain(time.monotonic() + HANG_S)
        names = [name_of(s) for s in snapshots(5)]
        assert sorted(far.asked) == sorted(names) and all(far.exists(n) for n in names)
        totals = up.counters.totals()
        assert totals["upload_backlog_resumed"] == 5 and totals["written_back_uploads"] == 5
    finally:
        up.close()


def test_after_a_damaged_backlog_file_the_blocks_on_nvme_only_are_found_and_uploaded(tmp_path) -> None:
    local, far = _tiers(tmp_path)
    first = uploads(local, Store([far]))
    first.stop()  # the process stops before it uploads anything
    snaps = snapshots(4)
    names = [write(local, first, s) for s in snaps]
    first.close()
    assert Store([far]).put(ACME, snaps[0])  # one reached S3 some other way
    path = first.backlog.path
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    path.write_bytes(b"\0garbage" * 512)  # the backlog's file is damaged: its rows are lost
    again = uploads(local, Store([far]), streams=2)
    try:
        assert again.backlog.damaged
        wait_for(lambda: again.counters.totals().get("upload_backlog_rescanned") == 4, "the tier rescanned")
        assert again.drain(time.monotonic() + HANG_S)
        totals = again.counters.totals()
        assert totals["upload_present"] == 1 and totals["written_back_uploads"] == 3
        assert all(far.exists(n) for n in names)
    finally:
        again.close()


@pytest.mark.s3
def test_a_backlog_drains_into_real_s3_after_a_restart_and_the_blocks_read_back(tmp_path, s3_url, s3_config) -> None:
    from store.config import StoreConfig

    local = LocalTier(tmp_path / "nvme", cap_bytes=64 << 20)
    s3 = tier_class(s3_url).from_url(s3_url, StoreConfig(s3=s3_config), create_bucket=True)
    first = uploads(local, Store([s3]), backoff_s=3600.0)
    first.stop()  # this process stops before it uploads anything
    snaps = snapshots(3)
    for s in snaps:
        write(local, first, s)
    first.close()
    again = uploads(local, Store([s3]), streams=2)
    try:
        assert again.backlog.resumed == 3 and again.drain(time.monotonic() + HANG_S)
        blocks = [make_chain(ROOT, 1, start=1000 * i)[0] for i in range(3)]
        for b in blocks:  # whole and checked, from S3 alone
            assert Store([s3]).get(ACME, b, ROOT) is not None
        # the PUTs ran on s3fs's loop thread, which the upload threads lowered as they lower themselves
        assert _nice_of("fsspecIO") == _nice_of("kvwarm-upload-0") > os.getpriority(os.PRIO_PROCESS, 0) or \
            not lowers_threads()
    finally:
        again.close()


def _nice_of(thread_name: str) -> int:
    import threading
    (t,) = [t for t in threading.enumerate() if t.name == thread_name]
    return os.getpriority(os.PRIO_PROCESS, t.native_id)


def lowers_threads() -> bool:
    from store.serving.priority import background_nice
    return hasattr(os, "setpriority") and background_nice() > 0 and os.getpriority(os.PRIO_PROCESS, 0) < 19


def test_idle_upload_threads_look_at_the_backlog_once_a_poll_not_in_a_loop(tmp_path: Path) -> None:
    """With nothing to send, each thread claims once per ``poll_s`` (and once per put): an empty claim once woke
    the other idle threads, which found nothing and woke it again, keeping a core busy in vLLM's process."""
    local, far = _tiers(tmp_path)
    up = uploads(local, Store([far]), streams=4, poll_s=0.5)
    claims = []
    claim = up.backlog.claim
    up.backlog.claim = lambda *a, **kw: claims.append(1) or claim(*a, **kw)  # type: ignore[method-assign]
    try:
        time.sleep(1.0)  # what is counted is claims, not time: a slower machine makes fewer, never more
        assert len(claims) <= 4 * (1.0 / 0.5 + 2), len(claims)
        name = write(local, up, snapshots(1)[0])  # and a put still wakes them at once
        wait_for(lambda: far.exists(name), "the upload of a block put while the threads were idle")
    finally:
        up.close()


def test_drain_waits_for_a_row_claimed_between_its_reads_of_the_backlog(tmp_path: Path) -> None:
    """A thread that claims a row after drain saw no thread busy, but before drain asked when the next
    unclaimed row is due, once made drain answer at once that nothing more could be sent (a CI flake)."""
    local, far = _tiers(tmp_path)
    far.held.clear()  # the upload stays in flight until the test lets it go
    up = uploads(local, Store([far]), streams=1)
    waiting = up.waiting
    names: list[str] = []

    def claimed_in_between() -> int:
        if not names:  # drain's first look: the thread is idle, then a put wakes it and it claims the row
            names.append(write(local, up, snapshots(1)[0]))
            wait_for(lambda: far.inflight == 1, "the upload in flight")
            threading.Timer(0.2, far.held.set).start()
        return waiting()

    up.waiting = claimed_in_between  # type: ignore[method-assign]
    try:
        assert up.drain(time.monotonic() + HANG_S)
        assert far.exists(names[0])
    finally:
        far.held.set()
        up.close()
