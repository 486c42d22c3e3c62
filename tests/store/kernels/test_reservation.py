"""One reservation lent out a frame at a time: aligned slices, given back, a high-water mark, a bound."""
from __future__ import annotations

import threading

import pytest
import torch

from store.errors import ConfigError
from store.kernels.gather import FP8_VALUES
from store.kernels.reservation import ALIGN, TABLE_BYTES, Loose, Reservation


def test_slices_are_aligned_views_of_the_one_buffer_and_given_back_when_the_frame_ends() -> None:
    res = Reservation(64 << 10, "cpu")
    base = res.buffer.data_ptr()
    with res.frame() as f:
        a = f.take((10,), torch.float32)
        b = f.take((3, 5), torch.bfloat16)
        assert a.data_ptr() == base + TABLE_BYTES and b.data_ptr() == base + TABLE_BYTES + ALIGN
        mark = f.mark()
        f.take((1000,), torch.uint8)
        f.release(mark)
        c = f.take((4,), torch.int64)
        assert c.data_ptr() == b.data_ptr() + ALIGN  # the released bytes again
    assert res.peak == TABLE_BYTES + 2 * ALIGN + 1024
    with res.frame() as f:
        assert f.take((1,), torch.uint8).data_ptr() == base + TABLE_BYTES  # reused, nothing new
    assert res.frames == 2 and res.buffer.data_ptr() == base
    assert torch.equal(res.fp8_values.view(torch.int32), FP8_VALUES.view(torch.int32))


def test_a_take_past_the_end_is_refused_and_a_reservation_too_small_for_the_table_too() -> None:
    res = Reservation(4096, "cpu")
    with res.frame() as f:
        f.take((res.usable,), torch.uint8)
        with pytest.raises(ConfigError, match="device_scratch_bytes"):
            f.take((1,), torch.uint8)
    assert res.peak == res.size
    with pytest.raises(ConfigError, match="at least"):
        Reservation(100, "cpu")


def test_frames_are_taken_one_at_a_time() -> None:
    res = Reservation(8192, "cpu")
    inside, overlap = [0], [False]

    def turn() -> None:
        for _ in range(200):
            with res.frame() as f:
                inside[0] += 1
                overlap[0] |= inside[0] > 1
                f.take((100,), torch.uint8).fill_(1)
                inside[0] -= 1

    threads = [threading.Thread(target=turn) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlap[0] and res.frames == 600


def test_loose_is_torchs_allocator() -> None:
    mem = Loose("cpu")
    t = mem.take((2, 3), torch.float16)
    assert t.shape == (2, 3) and t.dtype == torch.float16 and mem.mark() == 0
    assert torch.equal(mem.fp8_values.view(torch.int32), FP8_VALUES.view(torch.int32))


def test_the_config_sizes_the_one_reservation_a_dequantizer_lends_per_device() -> None:
    from store.config import parse_config
    from store.kernels.dequant import Dequantizer
    from store.kernels.reservation import SCRATCH_BYTES

    assert int(parse_config({}).loader.device_scratch_bytes) == SCRATCH_BYTES == 256 << 20
    size = int(parse_config({"loader": {"device_scratch_bytes": "8MiB"}}).loader.device_scratch_bytes)
    dq = Dequantizer(scratch_bytes=size)
    res = dq.reservation("cpu")
    assert res.size == 8 << 20 and dq.reservation(torch.device("cpu")) is res  # taken once
    with pytest.raises(ValueError, match="device_scratch_bytes"):
        parse_config({"loader": {"device_scratch_bytes": "512KiB"}})
