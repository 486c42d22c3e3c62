"""Whole-payload dequantisation of mixed-precision snapshots (FP8 layers and layers kept in bf16/fp16).

``Dequantizer.payload_layers`` must give, for every layout that ``keep_layers`` makes, the bits
of each part dequantised alone (``store.format.precision.dequantize``) in the same order, with one
operation per group (FP8 layers, kept layers) per snapshot.
"""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from store.format.encode import build_snapshot, snapshot_bytes
from store.format.payload import map_file
from store.format.precision import Precision
from store.format.runs import payload_plan
from store.format.snapshot import read_snapshot
from store.kernels.dequant import Dequantizer
from tests.store.factories import ACME, make_chain, make_root
from tests.store.kernels.reference import BS, LAYERS, mapped, payloads, reference, same_bits


@pytest.fixture(scope="module")
def compiled() -> Dequantizer:
    """One compiled dequantiser for the module: kernels (and the staging buffer) are reused across layouts."""
    return Dequantizer("compiled")


@pytest.mark.parametrize("keep, dtype", [
    ((0,), torch.bfloat16),
    ((0,), torch.float32),
    ((0, LAYERS - 1), torch.bfloat16),
    ((2,), torch.bfloat16),  # a middle layer: FP8 layers on both sides
])
def test_compiled_mixed_payloads_give_the_bits_of_each_part_dequantised_alone(tmp_path, compiled, keep, dtype):
    snaps = mapped(tmp_path, Precision(keep_layers=keep), 3)
    for tokens in (3 * BS, 3 * BS - 5, BS + 1):  # whole blocks, and ending mid-block
        got = compiled.payload_layers(payloads(snaps), tokens, dtype)
        assert same_bits(got, reference(snaps, tokens, dtype))
        assert all(t.shape == (2, tokens, 8) for t in got)
    assert all(not p[0].flags.writeable for p in payloads(snaps))  # the mapping is read, never written


@pytest.mark.parametrize("keep", [(0,), (0, LAYERS - 1), (2,), (1, 3), (0, 1), (3, 4), (0, 2, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_before_its_kernel_is_built_reads_mixed_payloads_through_the_table(tmp_path, keep, dtype, numpy_table):
    snaps = mapped(tmp_path, Precision(keep_layers=keep), 2)
    layout = snaps[0].payload[1]
    with cf.ThreadPoolExecutor(1) as ex:
        auto = Dequantizer("auto", ex)
        auto._pending.add(("payload", layout.nbytes, payload_plan(layout), dtype))  # "being built" in the background
        for tokens in (2 * BS, 2 * BS - 3, 1):
            assert same_bits(auto.payload_layers(payloads(snaps), tokens, dtype), reference(snaps, tokens, dtype))
        assert not auto._ready and len(auto._pending) == 1  # no second kernel started


def test_auto_uses_the_kernel_once_it_is_built(tmp_path, numpy_table):
    # without the native gather (an install with no C compiler); with it, auto never compiles (test_table.py)
    snaps = mapped(tmp_path, Precision(keep_layers=(0,)), 4)
    auto = Dequantizer("auto")  # no executor: builds on first use
    got = auto.payload_layers(payloads(snaps), 4 * BS - 7, torch.bfloat16)
    assert auto._ready and same_bits(got, reference(snaps, 4 * BS - 7, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_payloads_match_the_per_part_dequantizer(tmp_path, compiled, dtype):
    # what to_dynamic_cache falls back to (Dequantizer.layers over every part of the hit, the
    # table path: kept parts copied as numpy copies, the trimmed last block too) gives the same bits
    snaps = mapped(tmp_path, Precision(keep_layers=(0, 3)), 3)
    runs = [[(s.tensor(f"{n}.{i}"), s.tensor(f"{n}_scale.{i}") if f"{n}_scale.{i}" in s._parts else None)
             for s in snaps] for i in range(LAYERS) for n in ("k", "v")]
    for tokens in (3 * BS, 3 * BS - 2):
        want = reference(snaps, tokens, dtype)
        assert same_bits(Dequantizer("table").layers(runs, tokens, dtype), want)
        assert same_bits(compiled.payload_layers(payloads(snaps), tokens, dtype), want)


def test_kept_fp16_layers_are_converted_as_dequantize_converts(tmp_path, numpy_table):
    snaps = mapped(tmp_path, Precision(keep_layers=(1, 4), keep_dtype="fp16"), 2)
    layout = snaps[0].payload[1]
    with cf.ThreadPoolExecutor(1) as ex:
        auto = Dequantizer("auto", ex)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            auto._pending.add(("payload", layout.nbytes, payload_plan(layout), dtype))
            got = auto.payload_layers(payloads(snaps), 2 * BS - 1, dtype)
            assert same_bits(got, reference(snaps, 2 * BS - 1, dtype))


def test_one_copy_per_group_per_snapshot(tmp_path):
    """The plan behind the path: kept layers in one strided view where their offsets allow,
    FP8 layers in one staging segment per stretch of FP8 layers."""
    def plan(keep, layers=12):
        return payload_plan(mapped(tmp_path / str(keep), Precision(keep_layers=keep), 1, layers=layers)[0].payload[1])

    first = plan((0,))
    assert first is not None and len(first.plain) == 1 and len(first.fp8.segments) == 1
    assert first.plain_layers == (0,) and first.fp8.layers == tuple(range(1, 12)) and first.m == 24
    ends = plan((0, 11))
    assert len(ends.plain) == 1 and ends.plain[0].count == 2 and len(ends.fp8.segments) == 1
    middle = plan((5,))
    assert len(middle.plain) == 1 and len(middle.fp8.segments) == 2
    several = plan((0, 3, 7))  # not at one step: two strided copies for the kept layers
    assert len(several.plain) == 2 and len(several.fp8.segments) == 3
    assert plan(()).plain == () and len(plan(()).fp8.segments) == 1  # uniform FP8: the whole payload, as before
    assert plan((0,)) is first  # cached per (interned) layout


def test_mixed_payloads_fall_back_where_this_path_does_not_apply(tmp_path, compiled, numpy_table):
    mixed = mapped(tmp_path / "m", Precision(keep_layers=(0,)), 2)
    grouped = mapped(tmp_path / "g", Precision(granularity="head_group", group_tokens=4, keep_layers=(0,)), 2)
    other = mapped(tmp_path / "o", Precision(keep_layers=(1,)), 2)
    assert payload_plan(grouped[0].payload[1]) is None
    assert compiled.payload_layers(payloads(grouped), 2 * BS, torch.bfloat16) is None  # per-group scales
    assert Dequantizer("table").payload_layers(payloads(mixed), 2 * BS, torch.bfloat16) is None  # FP8 in table mode
    assert compiled.payload_layers(payloads(mixed[:1]), BS, torch.bfloat16) is None  # one block
    assert compiled.payload_layers([mixed[0].payload, other[1].payload], 2 * BS, torch.bfloat16) is None
    assert compiled.payload_layers(payloads(mixed), 2 * BS + 1, torch.bfloat16) is None  # too many tokens


def test_kept_bf16_widened_to_fp32_keeps_every_bit(tmp_path, numpy_table):
    # signed zeros, subnormals and the largest bf16 values in the kept layer: the fp32 output
    # is exactly what Tensor.to gives, bit for bit
    precision = Precision(keep_layers=(0,))
    root = make_root(precision=precision, block_size=BS)
    special = torch.tensor([-0.0, 0.0, 1e-40, -1e-40, 3.0e38, -3.0e38, 1.0, -2.5]).repeat(2 * BS)
    g = torch.Generator().manual_seed(1)
    tmp_path.mkdir(parents=True, exist_ok=True)
    snaps = []
    for b in make_chain(root, 2):
        kv = [(special.view(2, BS, 8), -special.view(2, BS, 8))] + [
            (torch.randn((2, BS, 8), generator=g), torch.randn((2, BS, 8), generator=g)) for _ in range(2)]
        enc = build_snapshot(root=root, block=b, tenant=ACME.name, kv=kv, precision=precision, created_at=0.0,
                             ttl_s=60.0)
        (tmp_path / f"{b.index}.kvw").write_bytes(snapshot_bytes(enc))
        snaps.append(read_snapshot(map_file(tmp_path / f"{b.index}.kvw")))
    layout = snaps[0].payload[1]
    with cf.ThreadPoolExecutor(1) as ex:
        auto = Dequantizer("auto", ex)
        auto._pending.add(("payload", layout.nbytes, payload_plan(layout), torch.float32))
        got = auto.payload_layers(payloads(snaps), 2 * BS - 1, torch.float32)
    want = reference(snaps, 2 * BS - 1, torch.float32)
    assert same_bits(got, want)
    assert torch.signbit(got[0][0, 0, 0]) and got[0].abs().max() > 1e38  # the specials made it through
