"""FP8 dequantisation by table (store.kernels.table): the native gather and numpy's give the reference bits."""
from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest
import torch

import store.kernels.table
from store.format.precision import Precision, dequantize
from store.format.runs import payload_plan
from store.kernels.dequant import Dequantizer, dequantize_into
from store.kernels.table import gather_parts, gather_payloads, native_isa
from tests.store.kernels.reference import BS, mapped, reference, same_bits

EVERY_BYTE = torch.arange(256, dtype=torch.uint8)


@pytest.mark.skipif(shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC")
                                 else "cc") is None, reason="no C compiler: the install has numpy only")
def test_the_native_gather_is_built_where_a_compiler_is():
    # setup.py builds it as optional; a silent build failure would leave every hit on numpy
    assert native_isa() in ("avx512bw", "avx2", "scalar")
    with pytest.raises(ValueError, match="unknown instruction set"):
        store.kernels.table._native.use_isa("sse9")
    assert native_isa() in ("avx512bw", "avx2", "scalar")


def special_parts(heads: int = 3, tokens: int = 40, dim: int = 64):
    """Every FP8 byte (NaN and signed zeros included) in every head, shuffled, and scales that give
    subnormal, ordinary and overflowing (inf) bf16 results."""
    g = torch.Generator().manual_seed(3)
    raw = torch.stack([EVERY_BYTE.repeat(tokens * dim // 256 + 1)[:tokens * dim][torch.randperm(tokens * dim, generator=g)]
                       for _ in range(heads)]).view(heads, tokens, dim)
    scale = torch.tensor([1e-40, 0.37, 3e36][:heads], dtype=torch.float32)
    return raw.view(torch.float8_e4m3fn), scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(params=["best", "scalar", "numpy"])
def gather_impl(request, monkeypatch):
    """Each implementation of the gather: the native one with the CPU's best instruction set
    (AVX-512BW or AVX2), the native plain loop (what other CPUs run), numpy's take."""
    if request.param == "numpy":
        monkeypatch.setattr(store.kernels.table, "_native", None)
        yield request.param
        return
    if native_isa() is None:
        pytest.skip("native gather not built")
    store.kernels.table._native.use_isa(request.param)
    try:
        yield request.param
    finally:
        store.kernels.table._native.use_isa("best")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_parts_gives_the_reference_bits_for_every_byte(gather_impl, dtype):
    stored, scale = special_parts()
    want = dequantize(stored, scale, dtype)
    assert torch.isnan(want).any() and torch.isinf(want).any()  # the specials are there
    out = torch.empty(stored.shape, dtype=dtype)
    assert gather_parts(out, stored, scale)
    assert torch.equal(bits(out), bits(want))
    # a stored part that is not contiguous per head (a slice across tokens) is read right too
    sliced = stored[:, :, :32]
    out2 = torch.empty(sliced.shape, dtype=dtype)
    assert gather_parts(out2, sliced, scale)
    assert torch.equal(bits(out2), bits(dequantize(sliced.contiguous(), scale, dtype)))


def test_gather_parts_declines_what_it_does_not_cover():
    stored, scale = special_parts()
    wide = torch.zeros((3, 40, 128), dtype=torch.bfloat16)
    out = wide[:, :, :64]  # heads not contiguous in the output
    assert not gather_parts(out, stored, scale)
    assert not wide.any()  # nothing written
    dequantize_into(out, stored, scale)  # the caller's fallback: through a temporary
    assert torch.equal(bits(out.contiguous()), bits(dequantize(stored, scale, torch.bfloat16)))
    assert not gather_parts(torch.empty((3, 40, 64), dtype=torch.bfloat16), stored, scale[:2])  # scale per head
    assert not gather_parts(torch.empty((3, 40, 64), dtype=torch.float64), stored, scale)  # 8-byte output
    assert not gather_parts(torch.empty((3, 40, 64)), stored.view(torch.uint8), scale)  # not FP8


needs_native = pytest.mark.skipif(native_isa() is None, reason="native gather not built")


@needs_native
@pytest.mark.parametrize("keep", [(), (0,), (0, 4), (2,), (1, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("isa", ["best", "scalar"])
def test_whole_payloads_through_the_native_gather_give_the_reference_bits(tmp_path, keep, dtype, isa):
    store.kernels.table._native.use_isa(isa)
    try:
        _whole_payloads_give_the_reference_bits(tmp_path, keep, dtype)
    finally:
        store.kernels.table._native.use_isa("best")


def _whole_payloads_give_the_reference_bits(tmp_path, keep, dtype):
    snaps = mapped(tmp_path, Precision(keep_layers=keep), 3)
    table = Dequantizer("table")
    for tokens in (3 * BS, 3 * BS - 5, BS + 1, 1):  # whole blocks, mid-block, a single token
        assert same_bits(table.payload_layers([s.payload for s in snaps], tokens, dtype),
                         reference(snaps, tokens, dtype))
    one = table.payload_layers([snaps[0].payload], BS - 2, dtype)  # one block is fine here
    assert same_bits(one, reference(snaps[:1], BS - 2, dtype))
    assert all(not s.payload[0].flags.writeable for s in snaps)  # the mappings are read, never written


@needs_native
def test_an_output_dtype_without_tables_takes_the_per_part_path(tmp_path):
    snaps = mapped(tmp_path, Precision(keep_layers=(0,)), 2)
    table = Dequantizer("table")
    assert table.payload_layers([s.payload for s in snaps], 2 * BS, torch.float64) is None  # no 8-byte tables
    runs = [[(s.tensor(f"{n}.{i}"), s.tensor(f"{n}_scale.{i}") if f"{n}_scale.{i}" in s._parts else None)
             for s in snaps] for i in range(5) for n in ("k", "v")]
    got, want = table.layers(runs, 2 * BS, torch.float64), reference(snaps, 2 * BS, torch.float64)
    assert all(a.dtype == torch.float64 and torch.equal(a, b) for a, b in zip(got, want))


@needs_native
def test_auto_takes_the_native_gather_and_never_compiles(tmp_path):
    snaps = mapped(tmp_path, Precision(keep_layers=(0,)), 2)
    auto = Dequantizer("auto")  # no executor: a kernel would be built inline, on this call
    got = auto.payload_layers([s.payload for s in snaps], 2 * BS, torch.bfloat16)
    assert same_bits(got, reference(snaps, 2 * BS, torch.bfloat16))
    assert not auto._ready and not auto._pending and auto._kernel is None


@needs_native
def test_payloads_that_do_not_match_the_plan_are_refused(tmp_path):
    snaps = mapped(tmp_path, Precision(), 2)
    plan = payload_plan(snaps[0].payload[1])
    arrays = [s.payload[0] for s in snaps]
    with pytest.raises(ValueError, match="do not match the plan"):
        gather_payloads([arrays[0], arrays[1][:-8]], plan, 2 * BS, torch.bfloat16)  # a short payload
    with pytest.raises(ValueError, match="do not match the plan"):
        gather_payloads(arrays, plan, 2 * BS + 1, torch.bfloat16)  # more tokens than blocks
    assert gather_payloads(arrays, plan, 2 * BS, torch.float64) is None  # no 8-byte tables
    out = gather_payloads(arrays, plan, 2 * BS, torch.bfloat16)
    assert out is not None and out.shape == (2 * 5, 2, 2 * BS, 8)
    assert np.all([not a.flags.writeable for a in arrays])


@needs_native
@pytest.mark.parametrize("precision, dtype", [
    (Precision(compression="bf16"), torch.bfloat16),  # no FP8 layer: plain copies only
    (Precision(compression="fp16"), torch.float16),
    (Precision(keep_layers=(1, 3), keep_dtype="fp16"), torch.float16),  # kept fp16 layers copied beside the gather
    (Precision(keep_layers=(1, 3), keep_dtype="fp16"), torch.bfloat16),  # ... or converted when stored otherwise
])
@pytest.mark.parametrize("isa", ["best", "scalar"])
def test_layers_stored_unquantised_are_copied_natively_with_their_bits(tmp_path, precision, dtype, isa):
    snaps = mapped(tmp_path, precision, 3)
    store.kernels.table._native.use_isa(isa)
    try:
        for tokens in (3 * BS, 2 * BS + 3, 1):
            got = Dequantizer("table").payload_layers([s.payload for s in snaps], tokens, dtype)
            assert same_bits(got, reference(snaps, tokens, dtype))
    finally:
        store.kernels.table._native.use_isa("best")


@needs_native
@pytest.mark.parametrize("isa", ["best", "scalar"])
def test_native_block_copies_move_exactly_the_bytes_asked(isa):
    # rows of 8 KiB and more take streaming stores when 64-byte aligned (every row of an
    # aligned output here); the last block's short rows and the rest memcpy
    g = np.random.default_rng(5)
    block, dim, tokens = 64, 64, 150  # 3 blocks, the last one 22 tokens
    src = [g.integers(0, 256, 3 * block * dim * 2 + 64, dtype=np.uint8) for _ in range(3)]
    out = np.zeros(2 * tokens * dim * 2 + 64, dtype=np.uint8)
    start = (-out.ctypes.data) % 64
    rows = np.array([1, 0], dtype=np.uint64)
    offs = np.array([0, block * dim * 2 + 8], dtype=np.uint64)  # head 0 -> out row 1, head 1 -> row 0
    store.kernels.table._native.use_isa(isa)
    try:
        store.kernels.table._native.copy_blocks(np.array([a.ctypes.data for a in src], np.uint64), offs, rows,
                                        out.ctypes.data + start, tokens, block, dim, 2)
    finally:
        store.kernels.table._native.use_isa("best")
    got = out[start:start + 2 * tokens * dim * 2].view(np.int16).reshape(2, tokens, dim)
    for i, a in enumerate(src):
        n = min(block, tokens - i * block)
        for off, row in zip(offs, rows):
            want = a[int(off):int(off) + n * dim * 2].view(np.int16).reshape(n, dim)
            assert np.array_equal(got[int(row), i * block:i * block + n], want)
    assert not out[:start].any() and not out[start + 2 * tokens * dim * 2:].any()  # nothing outside


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tables_made_natively_are_torchs_for_every_byte_and_scale(dtype):
    # gather_blocks makes each head's table in C; the reference is store.kernels.table.tables (torch)
    scales = torch.tensor([1e-40, 2.5e-39, 0.37, 1.0, 448.0, 3e36, 1e38], dtype=torch.float32)
    heads = len(scales)
    payload = np.zeros(heads * 256 + 4 * heads, dtype=np.uint8)
    payload[:heads * 256] = np.tile(np.arange(256, dtype=np.uint8), heads)
    payload[heads * 256:] = scales.numpy().view(np.uint8)
    out = torch.empty((heads, 1, 256), dtype=dtype)
    h = np.arange(heads, dtype=np.uint64)
    store.kernels.table._native.gather_blocks(np.array([payload.ctypes.data], np.uint64), h * np.uint64(256),
                                      np.uint64(heads * 256) + 4 * h, h, store.kernels.table._FP8_NP, out.data_ptr(), 1,
                                      1, 256, dtype.itemsize)
    assert torch.equal(bits(out[:, 0]), bits(store.kernels.table.tables(scales, dtype)))
