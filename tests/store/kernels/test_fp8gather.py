"""The native gather (store/kernels/_fp8gather.c): its vector paths give the plain loop's bits.

For every byte value and every kind of table the code builds (bf16 tables made in C by
``gather_blocks``, bf16 and fp16 tables from torch through ``gather``), over scales that keep
every result normal (the AVX2 path's table form) and scales that do not (its fallback),
the CPU's best instruction set (``best``) against the plain loop (``scalar``), at run lengths
with and without a vector tail, into aligned outputs (streaming stores) and misaligned ones.
Runs on any CPU; only the check of which instruction set was chosen depends on it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import store.kernels.table
from store.kernels.table import native_isa, pin_native_isa, tables

pytestmark = pytest.mark.skipif(native_isa() is None, reason="native gather not built")

#: scales of every kind: ordinary, powers of two, results that reach bf16's subnormals or
#: overflow to inf, zero, negative, inf and NaN
SCALES = torch.tensor([0.37, 1.0, 2.0 ** -20, 448.0, 7e-3, -5.5, 1 / 448, 3.1e-5, 1e-40, 2.5e-39, 1e-36, 3e36,
                       1e38, 0.0, -0.0, float("inf"), float("nan")], dtype=torch.float32)
#: bytes per head: every byte value 9 times, then 7 more (a run that is not a multiple of 16)
RUN = 256 * 9 + 7


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


@pytest.fixture
def native():
    yield store.kernels.table._native
    store.kernels.table._native.use_isa("best")


def every_scale() -> torch.Tensor:
    """SCALES and 200 more, log-uniform over every exponent fp32 has, either sign."""
    g = torch.Generator().manual_seed(11)
    mag = torch.exp2(torch.empty(200).uniform_(-149, 128, generator=g))
    sign = torch.where(torch.rand(200, generator=g) < 0.5, -1.0, 1.0)
    return torch.cat([SCALES, (mag * sign).to(torch.float32)])


def shuffled_bytes(heads: int) -> np.ndarray:
    """``[heads, RUN]``: every byte value in every head, in a different order per head."""
    g = np.random.default_rng(4)
    base = np.concatenate([np.tile(np.arange(256, dtype=np.uint8), 9), np.arange(7, dtype=np.uint8)])
    return np.stack([g.permutation(base) for _ in range(heads)])


def aligned(nbytes: int, offset: int) -> tuple[np.ndarray, int]:
    """A zeroed buffer and the address ``offset`` bytes past a 64-byte boundary in it."""
    buf = np.zeros(nbytes + 128, dtype=np.uint8)
    return buf, buf.ctypes.data + (-buf.ctypes.data) % 64 + offset


def test_best_is_avx2_where_the_cpu_has_it_without_avx512bw(native):
    assert pin_native_isa("scalar") == "scalar" == native_isa()
    with pytest.raises(ValueError, match="unknown instruction set"):
        pin_native_isa("avx3")
    assert native_isa() == "scalar"  # a bad name changes nothing
    best = pin_native_isa("best")
    assert best in ("avx512bw", "avx2", "scalar") and native_isa() == best
    flags = _cpu_flags()
    if flags is None:
        pytest.skip("the CPU's flags cannot be read here (no /proc/cpuinfo): which path is best is unknown")
    if "avx2" not in flags or "avx512bw" in flags:
        pytest.skip("this CPU has AVX-512BW or no AVX2: its best path is not the AVX2 one (checked above)")
    assert best == "avx2"


def _gather_blocks(native, isa: str, src: np.ndarray, scales: torch.Tensor, out_offset: int) -> np.ndarray:
    """bf16 through gather_blocks (the tables made in C), one block of one token of RUN values per head."""
    heads = src.shape[0]
    payload = np.concatenate([src.reshape(-1), scales.numpy().view(np.uint8)])
    buf, out = aligned(heads * RUN * 2, out_offset)
    h = np.arange(heads, dtype=np.uint64)
    native.use_isa(isa)
    native.gather_blocks(np.array([payload.ctypes.data], np.uint64), h * np.uint64(RUN),
                         np.uint64(heads * RUN) + np.uint64(4) * h, h, store.kernels.table._FP8_NP, out, 1, 1, RUN, 2)
    start = out - buf.ctypes.data
    return buf[start:start + heads * RUN * 2].view(np.uint16).reshape(heads, RUN).copy()


@pytest.mark.parametrize("out_offset", [0, 2])  # aligned (streaming stores) and not
def test_tables_made_in_c_give_the_plain_loops_bits_for_every_byte_and_scale(native, out_offset):
    scales = every_scale()
    src = shuffled_bytes(len(scales))
    want = _gather_blocks(native, "scalar", src, scales, out_offset)
    got = _gather_blocks(native, "best", src, scales, out_offset)
    assert np.array_equal(got, want)
    # and the plain loop is torch's table, looked up
    ref = tables(scales, torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(want, np.take_along_axis(ref, src.astype(np.int64), axis=1))


def _gather(native, isa: str, src: np.ndarray, lut: np.ndarray, out_offset: int, count: int) -> np.ndarray:
    heads = src.shape[0]
    buf, out = aligned(heads * RUN * 2, out_offset)
    native.use_isa(isa)
    native.gather(src.ctypes.data + np.arange(heads, dtype=np.uint64) * np.uint64(RUN),
                  out + np.arange(heads, dtype=np.uint64) * np.uint64(RUN * 2), np.full(heads, count, np.uint64),
                  np.ascontiguousarray(lut), 2)
    start = out - buf.ctypes.data
    return buf[start:start + heads * RUN * 2].view(np.uint16).reshape(heads, RUN).copy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_offset", [0, 2])
@pytest.mark.parametrize("count", [RUN, 255, 17])  # long runs, and runs the vector path leaves to the loop
def test_torchs_tables_give_the_plain_loops_bits_for_every_byte_and_scale(native, dtype, out_offset, count):
    scales = every_scale()
    src = shuffled_bytes(len(scales))
    lut = tables(scales, dtype).view(torch.int16).numpy()
    want = _gather(native, "scalar", src, lut, out_offset, count)
    assert np.array_equal(want[:, :count], np.take_along_axis(lut.view(np.uint16), src[:, :count].astype(np.int64),
                                                              axis=1))
    assert not want[:, count:].any()
    assert np.array_equal(_gather(native, "best", src, lut, out_offset, count), want)


@pytest.mark.parametrize("out_offset", [0, 2])
def test_tables_of_any_values_give_the_plain_loops_bits(native, out_offset):
    # gather() takes any table: random bits have no form to use, and tables that have it
    # except in one entry must not be taken for ones that do
    g = np.random.default_rng(8)
    good = tables(torch.tensor([0.37, 1.0, 5.0]), torch.bfloat16).view(torch.int16).numpy()
    broken = np.repeat(good, 4, axis=0)
    for i, k in enumerate([3, 8, 0x7F, 0x80, 0xC5, 0xFF, 0x40, 0x17, 0x9A, 0x00, 0x88, 0x7E]):
        broken[i, k] ^= 1 << (i % 16)
    lut = np.concatenate([g.integers(-2 ** 15, 2 ** 15, (4, 256)).astype(np.int16), broken])
    src = shuffled_bytes(len(lut))
    want = _gather(native, "scalar", src, lut, out_offset, RUN)
    assert np.array_equal(want, np.take_along_axis(lut.view(np.uint16), src.astype(np.int64), axis=1))
    assert np.array_equal(_gather(native, "best", src, lut, out_offset, RUN), want)
