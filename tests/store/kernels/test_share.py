"""A worker's share of a snapshot (a pipeline stage's layers, a tensor-parallel rank's heads), read alone.

The native gather must give the reference bits of exactly the share, and run only the share's
jobs: each job reads one head of one part of one block, so the offsets it is handed say which
bytes were read. The per-part path (numpy, and the device path's staging) reads views of the
share's heads.
"""
from __future__ import annotations

import pytest
import torch

import store.kernels.table
from store.format.precision import Precision
from store.kernels.dequant import Dequantizer
from store.kernels.table import native_isa
from tests.store.kernels.recorder import Recorder, head_offsets, stored_fp8
from tests.store.kernels.reference import BS, LAYERS, mapped, reference, same_bits

HEADS, DIM = 4, 8
needs_native = pytest.mark.skipif(native_isa() is None, reason="native gather not built")


@pytest.fixture()
def recorder(monkeypatch):
    if native_isa() is None:
        pytest.skip("native gather not built")
    rec = Recorder(store.kernels.table._native)
    monkeypatch.setattr(store.kernels.table, "_native", rec)
    return rec


def share_of(full: list[torch.Tensor], layers, heads: slice) -> list[torch.Tensor]:
    return [full[2 * i + kv][heads].contiguous() for i in layers for kv in (0, 1)]


@needs_native
@pytest.mark.parametrize("layers, heads", [((2, 3), slice(0, 4)), ((0, 1, 2, 3, 4), slice(2, 4)),
                                           ((4, 0), slice(1, 3)), ((3,), slice(3, 4))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_share_through_the_native_gather_is_the_reference_share_and_reads_only_it(tmp_path, recorder, layers,
                                                                                    heads, dtype):
    snaps = mapped(tmp_path, Precision(keep_layers=(0,)), 3, heads=HEADS, dim=DIM)
    tokens = 3 * BS - 5
    got = Dequantizer("table").payload_layers([s.payload for s in snaps], tokens, dtype, layers=layers,
                                              heads=(heads.start, heads.stop))
    assert same_bits(got, share_of(reference(snaps, tokens, dtype), layers, heads))
    assert all(t.shape == (heads.stop - heads.start, tokens, DIM) for t in got)
    # the jobs handed to the native calls are the share's heads, each once, and nothing else
    layout, held = snaps[0].payload[1], range(heads.start, heads.stop)
    read = recorder.fp8_offsets()
    if dtype == torch.float16:  # addresses of each block's heads: back to payload offsets
        bases = sorted(int(s.payload[0].__array_interface__["data"][0]) for s in snaps)
        read = [a - max(b for b in bases if b <= a) for a in read]
        assert sorted(read) == sorted(head_offsets(layout, stored_fp8(layout, layers), held) * len(snaps))
    else:
        assert sorted(read) == sorted(head_offsets(layout, stored_fp8(layout, layers), held))
    if dtype == torch.bfloat16 and 0 in layers:
        assert sorted(recorder.copy_offsets()) == sorted(head_offsets(layout, (0,), held))
    else:
        assert not recorder.copy_offsets()


@needs_native
def test_the_whole_model_asked_as_a_share_is_the_whole_payload(tmp_path):
    snaps = mapped(tmp_path, Precision(keep_layers=(0,)), 2, heads=HEADS, dim=DIM)
    dq = Dequantizer("table")
    whole = dq.payload_layers([s.payload for s in snaps], 2 * BS, torch.bfloat16)
    asked = dq.payload_layers([s.payload for s in snaps], 2 * BS, torch.bfloat16, layers=range(LAYERS),
                              heads=(0, HEADS))
    assert same_bits(asked, whole)


def test_without_the_native_gather_a_share_is_read_part_by_part_from_views(tmp_path, monkeypatch):
    monkeypatch.setattr(store.kernels.table, "_native", None)
    snaps = mapped(tmp_path, Precision(keep_layers=(0,)), 2, heads=HEADS, dim=DIM)
    dq = Dequantizer("table")
    assert dq.payload_layers([s.payload for s in snaps], 2 * BS, torch.bfloat16, layers=(1, 2), heads=(2, 4)) is None
    runs = [[(s.tensor(f"{n}.{i}")[2:4], s.tensor(f"{n}_scale.{i}")[2:4]) for s in snaps] for i in (1, 2)
            for n in ("k", "v")]
    got = dq.layers(runs, 2 * BS - 3, torch.bfloat16)
    assert same_bits(got, share_of(reference(snaps, 2 * BS - 3, torch.bfloat16), (1, 2), slice(2, 4)))


def test_the_device_path_stages_only_the_shares_bytes(tmp_path):
    # the path of a hit bound for a GPU (the stored bytes staged, then dequantised where they arrive),
    # run with the CPU as the device: the staging buffer holds the share's heads and nothing more
    snaps = mapped(tmp_path, Precision(keep_layers=()), 3, heads=HEADS, dim=DIM)
    dq = Dequantizer("table")
    runs = [[(s.tensor(f"{n}.{i}")[1:3], s.tensor(f"{n}_scale.{i}")[1:3]) for s in snaps] for i in (3, 4)
            for n in ("k", "v")]
    y = dq._to_device(runs, torch.bfloat16, torch.device("cpu"))
    want = share_of(reference(snaps, 3 * BS, torch.bfloat16), (3, 4), slice(1, 3))
    assert same_bits(list(y), want)
    assert dq._staging.pinned_bytes == 4 * 3 * 2 * BS * DIM  # one slot, the share's FP8 bytes: a byte each


@needs_native
def test_a_share_that_is_not_the_payloads_is_refused(tmp_path):
    snaps = mapped(tmp_path, Precision(keep_layers=(0,)), 2, heads=HEADS, dim=DIM)
    dq = Dequantizer("table")
    with pytest.raises(ValueError, match="not distinct layers"):
        dq.payload_layers([s.payload for s in snaps], BS, torch.bfloat16, layers=(1, 1))
    with pytest.raises(ValueError, match="not distinct layers"):
        dq.payload_layers([s.payload for s in snaps], BS, torch.bfloat16, layers=(LAYERS,))
    with pytest.raises(ValueError, match="not a range"):
        dq.payload_layers([s.payload for s in snaps], BS, torch.bfloat16, heads=(2, HEADS + 1))
