"""Host staging for transfers to a device: bounded slots used in turn, pieces, reuse, shrinking.

Run with the CPU as the "device" (no pinning, no events): the pieces, the slots and what
arrives are what a GPU gets; the events that free a slot on a GPU are the one part left to
bench/gpu_check.sh.
"""
from __future__ import annotations

import gc
import time

import pytest
import torch

from store.kernels.staging import SHRINK_AFTER, SLOTS, Staging, gather_to_device
from tests.hang_guard import HANG_S


def parts(n: int, shape=(4, 8, 16), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, shape, generator=g, dtype=torch.uint8) for _ in range(n)]


def test_a_transfer_larger_than_a_slot_goes_through_in_pieces_and_arrives_whole() -> None:
    raw = parts(40)  # 40 x 512 bytes; a slot holds 2,048: ten pieces of 4
    staging = Staging(max_bytes=SLOTS * 2048)
    got = gather_to_device(raw, torch.device("cpu"), staging)
    assert torch.equal(got, torch.stack(raw))
    assert staging.pinned_bytes <= staging.max_bytes and staging.allocations == SLOTS  # two slots, made once


def test_slots_are_reused_and_never_exceed_the_bound() -> None:
    staging = Staging(max_bytes=SLOTS * 4096)
    for n in (3, 8, 5, 8, 1):
        raw = parts(n, seed=n)
        assert torch.equal(gather_to_device(raw, torch.device("cpu"), staging), torch.stack(raw))
        assert staging.pinned_bytes <= staging.max_bytes
    assert staging.allocations <= 2 * SLOTS  # grown once to what the pieces need, then reused


def test_a_slot_shrinks_after_a_run_of_small_pieces() -> None:
    staging = Staging(max_bytes=SLOTS * 8192)
    gather_to_device(parts(32), torch.device("cpu"), staging)  # two pieces of 8,192 bytes
    assert staging.pinned_bytes == SLOTS * 8192
    for _ in range(SHRINK_AFTER * SLOTS):
        gather_to_device(parts(1), torch.device("cpu"), staging)  # 512 bytes each
    assert staging.pinned_bytes == SLOTS * 512


def test_a_part_larger_than_a_slot_goes_through_in_byte_pieces_within_the_bound() -> None:
    staging = Staging(max_bytes=SLOTS * 200)
    raw = parts(3)  # 512-byte parts, 200-byte slots: pieces of 200, 200, 112
    assert torch.equal(gather_to_device(raw, torch.device("cpu"), staging), torch.stack(raw))
    assert staging.peak_bytes <= staging.max_bytes and staging.pinned_bytes == SLOTS * 200
    with pytest.raises(ValueError, match="larger than a slot"):
        staging.acquire(201, pin=False)


def test_the_slots_are_freed_once_idle_and_made_again_by_the_next_transfer() -> None:
    staging = Staging(max_bytes=SLOTS * 4096, idle_s=0.05)
    try:
        raw = parts(8)
        gather_to_device(raw, torch.device("cpu"), staging)
        assert staging.pinned_bytes > 0
        deadline = time.monotonic() + HANG_S
        while staging.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert staging.trims >= 1 and staging.pinned_bytes == 0
        assert torch.equal(gather_to_device(raw, torch.device("cpu"), staging), torch.stack(raw))
        assert 0 < staging.pinned_bytes <= staging.max_bytes
    finally:
        staging.close()
    assert staging.pinned_bytes == 0


def test_trim_gives_everything_back_and_a_bound_too_small_is_refused() -> None:
    staging = Staging(max_bytes=SLOTS * 4096)
    gather_to_device(parts(4), torch.device("cpu"), staging)
    staging.buffer(1000)
    staging.trim()
    assert staging.pinned_bytes == 0 and staging.host is None
    with pytest.raises(ValueError, match="at least"):
        Staging(max_bytes=1)


def test_the_timer_thread_ends_once_its_staging_is_gone() -> None:
    staging = Staging(max_bytes=SLOTS * 4096, idle_s=0.02)
    gather_to_device(parts(2), torch.device("cpu"), staging)
    timer = staging._timer
    assert timer is not None and timer.is_alive()
    del staging
    gc.collect()
    timer.join(HANG_S)
    assert not timer.is_alive()
