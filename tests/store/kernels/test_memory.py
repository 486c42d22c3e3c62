"""store.kernels.memory: large hit outputs in huge-page mappings, recycled only once every view is gone."""
from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

import store.kernels.memory as memory
from tests.hang_guard import HANG_S

MIB = 1 << 20
needs_mappings = pytest.mark.skipif(not sys.platform.startswith("linux") or not memory._ENABLED,
                                    reason="needs anonymous mappings (Linux)")


def mapped_at(addr: int) -> bool:
    """Whether ``addr`` lies in one of this process's mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.fixture(autouse=True)
def empty_free_list():
    memory.release_cached()
    yield
    gc.collect()
    memory.release_cached()


@needs_mappings
def test_a_large_tensor_is_recycled_only_after_its_last_view_goes():
    t = memory.empty((4 * MIB // 2 // 64, 64), torch.bfloat16)
    assert t.shape == (4 * MIB // 128, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.fill_(1.5)
    addr = t.data_ptr()
    assert addr % 4096 == 0  # a mapping of its own, not the allocator's heap
    view = t[-1]
    del t
    gc.collect()
    assert memory.cached_bytes() == 0  # a view still uses it: not on the free list
    other = memory.empty((4 * MIB // 2,), torch.bfloat16)
    assert other.data_ptr() != addr and torch.all(view == 1.5)  # and not handed out again
    other.fill_(2.5)
    addrs = {addr, other.data_ptr()}
    del view, other
    gc.collect()
    assert memory.cached_bytes() == 2 * 4 * MIB
    again = memory.empty((4 * MIB // 2,), torch.bfloat16)
    assert again.data_ptr() in addrs  # one of the two freed mappings ...
    # ... already faulted in: every page still holds what its last user wrote (a page the
    # kernel maps anew reads as zeros), so writing it costs no page fault
    assert bool(torch.all(again == (1.5 if again.data_ptr() == addr else 2.5)))  # what that mapping's user wrote


@needs_mappings
def test_the_free_list_is_bounded_and_can_be_emptied(monkeypatch):
    monkeypatch.setattr(memory, "_CAP", 6 * MIB)
    ts = [memory.empty((2 * MIB,), torch.uint8) for _ in range(4)]
    addrs = [t.data_ptr() for t in ts]
    del ts
    gc.collect()
    assert memory.cached_bytes() == 6 * MIB  # the oldest beyond the cap was unmapped
    assert sum(mapped_at(a) for a in addrs) == 3
    assert memory.release_cached() == 6 * MIB and memory.cached_bytes() == 0
    gc.collect()
    assert not any(mapped_at(a) for a in addrs)  # nothing is kept: no leak per hit


@needs_mappings
def test_a_free_buffer_serves_only_requests_of_about_its_size():
    big = memory.empty((32 * MIB,), torch.uint8)
    addr = big.data_ptr()
    del big
    small = memory.empty((4 * MIB,), torch.uint8)  # 8x smaller: a new mapping, the big one stays free
    assert small.data_ptr() != addr and memory.cached_bytes() == 32 * MIB
    near = memory.empty((27 * MIB,), torch.uint8)  # within the slack: takes it
    assert near.data_ptr() == addr and near.numel() == 27 * MIB


@needs_mappings
def test_buffers_freed_on_other_threads_come_back():
    out: list[torch.Tensor] = []
    th = threading.Thread(target=lambda: out.append(memory.empty((2 * MIB,), torch.uint8)))
    th.start()
    th.join()
    addr = out[0].data_ptr()
    done = threading.Thread(target=out.clear)
    done.start()
    done.join()
    assert memory.empty((2 * MIB,), torch.uint8).data_ptr() == addr


def test_small_tensors_and_disabled_recycling_use_torch_empty(monkeypatch):
    small = memory.empty((4, 8), torch.float32)
    assert small.shape == (4, 8) and small.dtype == torch.float32
    monkeypatch.setattr(memory, "_ENABLED", False)  # KVWARM_HUGE_PAGES=0
    big = memory.empty((8 * MIB // 4,), torch.float32)
    big.fill_(2.0)
    assert big.shape == (8 * MIB // 4,) and float(big[-1]) == 2.0
    del big
    assert memory.cached_bytes() == 0


def test_a_bad_recycle_cap_is_named(monkeypatch):
    monkeypatch.setenv("KVWARM_RECYCLE_BYTES", "lots")
    with pytest.raises(ValueError, match="KVWARM_RECYCLE_BYTES must be a whole number of bytes >= 0, got 'lots'"):
        memory._cap_from_env()
    monkeypatch.setenv("KVWARM_RECYCLE_BYTES", "0")
    assert memory._cap_from_env() == 0


@needs_mappings
def test_a_child_forked_while_the_lock_is_held_can_still_allocate():
    import os

    with memory._lock:  # another thread inside empty() at the moment of the fork
        pid = os.fork()
        if pid == 0:  # the child: must not wait on a lock nobody will release
            try:
                t = memory.empty((2 * MIB,), torch.uint8)
                t[-1] = 1  # one element: no intra-op threads, which a forked child must not start
                os._exit(0 if int(t[-1]) == 1 else 1)
            except BaseException:
                os._exit(2)
    import signal
    import time

    deadline = time.monotonic() + HANG_S  # a hang guard
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # still waiting on the lock: kill it and fail
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in memory.empty (its lock was held at the fork)")
    assert os.waitstatus_to_exitcode(done[1]) == 0
