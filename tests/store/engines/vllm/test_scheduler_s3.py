"""The scheduler role with a real S3 tier (SeaweedFS): background and waited copies, and S3 killed mid-run.

The sync role runs on a clock the test holds: a waited request stops waiting when its copy is
done or when the test moves that clock past its deadline, never because the host was slow.
"""
from __future__ import annotations

import itertools
import time
import uuid

import concurrent.futures as cf
import threading

import pytest

from store.engines.vllm import fetches
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.scheduler_fakes import KB, Req, config, role, store_prefix, tokens


class Clock:
    """The scheduler's monotonic clock, moved only by the test."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


def ask_until(r, req) -> int:
    """Ask as vLLM does, once per step, until the answer is not "ask again" (a hang fails after HANG_S)."""
    guard = time.monotonic() + HANG_S
    while (n := r.get_num_new_matched_tokens(req, 0)[0]) is None:
        assert time.monotonic() < guard, f"still 'ask again' after {HANG_S:g} s: a hang"
        time.sleep(0.02)
    return n


@pytest.mark.s3
def test_s3_hits_follow_fetch_mode_and_s3_killed_is_a_counted_miss(tmp_path, own_s3, monkeypatch) -> None:
    # Generous S3 timeouts: the outage here is a stopped server (refused at once), not a slow one.
    s3 = {"endpoint_url": own_s3.endpoint, "access_key_env": "KVWARM_TEST_KEY", "secret_key_env": "KVWARM_TEST_SECRET",
          "op_timeout_s": 60, "connect_timeout_s": 10, "read_timeout_s": 30, "retries": 0}
    timeout = 8.0  # the sync wait, on the test's clock
    monkeypatch.setattr(fetches, "PAUSE_S", 0.0)  # each ask returns at once: the waits below are the clock's
    url = f"s3://kvwarm-conn/{uuid.uuid4().hex[:8]}"
    p1, p2, p3 = (tokens(3 * KB + 1, seed=s) for s in (50, 51, 52))
    for ids in (p1, p2, p3):
        store_prefix(tmp_path, ids, url=f"file://{tmp_path}/writer,{url}", cfg=config(s3))

    bg = role(tmp_path / "bg", url=f"file://{tmp_path}/bg,{url}", cfg=config(s3))
    assert bg.get_num_new_matched_tokens(Req("a", p1), 0) == (0, False)  # answered now ...
    assert bg.stats()["misses:fetch_scheduled"] == 1
    ids = (f"c{i}" for i in itertools.count())
    guard = time.monotonic() + HANG_S
    while bg.get_num_new_matched_tokens(Req(next(ids), p1), 0)[0] == 0:  # ... and local next time
        assert time.monotonic() < guard, f"the background copy did not land in {HANG_S:g} s: a hang"
        time.sleep(0.1)

    clock = Clock()
    sync = role(tmp_path / "sync", url=f"file://{tmp_path}/sync,{url}", cfg=config(s3, fetch_mode="sync",
                sync_fetch_timeout_s=timeout), rate=100, clock=clock)
    assert sync.get_num_new_matched_tokens(Req("s1", p2), 0) == (None, False)  # waits for the copy ...
    assert ask_until(sync, Req("s1", p2)) == 3 * KB  # ... however long it takes on the clock, then loads from NVMe
    assert "shortened:fetch_timeout" not in sync.stats()

    own_s3.stop()  # S3 gone mid-run
    assert bg.get_num_new_matched_tokens(Req("k-bg", p3), 0) == (0, False)  # only in S3: a miss, never an exception
    k = Req("k-sync", p3)
    assert sync.get_num_new_matched_tokens(k, 0) == (None, False)  # waits for a copy from the dead S3 ...
    clock.now += timeout + 1  # ... past its deadline: whether or not the copy has failed by now, it is a miss
    assert sync.get_num_new_matched_tokens(k, 0) == (0, False)
    assert ask_until(sync, Req("s2", p2)) == 3 * KB  # NVMe keeps serving
    misses = {k: v for k, v in sync.stats().items() if k.startswith("misses:")}
    assert set(misses) <= {"misses:fetch_timeout", "misses:store_unavailable"} and sum(misses.values()) == 1
    bg.close()
    sync.close()


def test_a_waiting_ask_gives_the_copy_its_pause_and_ends_it_when_the_copy_lands() -> None:
    """The scheduler waits on the copy briefly before "ask again", so the copy's threads get the GIL
    (vLLM's loop asking again at once starved them: a sync fetch of 8 blocks took over a second)."""
    future: cf.Future = cf.Future()
    pending = fetches.Pending(future, deadline=float("inf"))
    threading.Timer(0.01, future.set_result, args=((3, None),)).start()
    pending.pause(HANG_S)  # returns when the copy lands, well before the hang guard
    assert future.done() and not pending.waiting(0.0)
    idle = fetches.Pending(cf.Future(), deadline=float("inf"))
    idle.pause(0.0)  # a copy still running: the pause ends, the request still waits
    assert idle.waiting(0.0)
