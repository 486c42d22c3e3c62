"""store.memory: large hit outputs in huge-page-advised mappings, freed with their tensors."""
from __future__ import annotations

import gc
import sys

import pytest
import torch

import store.memory as memory


def mapped_at(addr: int) -> bool:
    """Whether ``addr`` lies in one of this process's mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not memory._ENABLED, reason="needs MADV_HUGEPAGE")
def test_a_large_tensor_owns_its_mapping_until_its_last_view_goes():
    t = memory.empty((memory.HUGE_MIN_BYTES // 2 // 64, 64), torch.bfloat16)
    assert t.shape == (memory.HUGE_MIN_BYTES // 128, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.fill_(1.5)
    addr = t.data_ptr()
    assert addr % 4096 == 0  # a mapping of its own, not the allocator's heap
    view = t[-1]
    del t
    gc.collect()
    assert mapped_at(addr) and torch.all(view == 1.5)  # a view keeps the mapping
    del view
    gc.collect()
    assert not mapped_at(addr)  # unmapped with the last view: no leak per hit


def test_small_tensors_and_disabled_advice_use_torch_empty(monkeypatch):
    small = memory.empty((4, 8), torch.float32)
    assert small.shape == (4, 8) and small.dtype == torch.float32
    monkeypatch.setattr(memory, "_ENABLED", False)  # KVWARM_HUGE_PAGES=0
    big = memory.empty((memory.HUGE_MIN_BYTES // 4,), torch.float32)
    big.fill_(2.0)
    assert big.shape == (memory.HUGE_MIN_BYTES // 4,) and float(big[-1]) == 2.0
