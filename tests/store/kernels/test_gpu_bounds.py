"""On a GPU only (bench/gpu_check.sh runs this file where one is lent): the chunked kernels on CUDA take no
device memory beyond the reservation, and give the CPU's bits.

torch's own counter (``max_memory_allocated``) is the witness: a load and a save of far more blocks than
the reservation holds at once allocate, beyond what they return, at most a little (ids, reduction
scratch of a few KiB), never a size that grows with the work.
"""
from __future__ import annotations

import pytest
import torch

from store.format.precision import Precision
from store.kernels.chunks import quantise_to_host, scatter_stored
from store.kernels.gather import block_ids, gather_quantise
from store.kernels.reservation import Reservation
from store.kernels.staging import Staging
from tests.store.kernels.chunking import stored_parts
from tests.store.kernels.engine_caches import layout, random_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh)")

H, B, D, NB, RATIO = 8, 16, 128, 512, 16  # 8B-shaped heads; kvwarm blocks of 256 tokens
SLACK = 1 << 20  # what torch may allocate besides (index and reduction scratch), whatever the size of the work


def test_a_large_load_and_save_on_cuda_stay_within_the_reservation_with_the_cpus_bits() -> None:
    dev = torch.device("cuda")
    lay = layout("split", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16)
    cpu_cache = random_cache(lay, seed=3)
    cache = cpu_cache.to(dev)
    res = Reservation(16 << 20, dev)  # a few blocks a chunk; the work below is 32 blocks (64 MiB as fp32)
    staging = Staging(4 << 20)
    runs = stored_parts(32, H, RATIO * B, D, Precision(), seed=1)
    ids = list(range(3, 3 + 32 * RATIO - 5))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert scatter_stored(cache, lay, block_ids(ids, dev), runs, skip=5, staging=staging, reservation=res)
    saved = quantise_to_host(cache, lay, block_ids(ids[:16 * RATIO], dev), ratio=RATIO, precision=Precision(),
                             layer=0, reservation=res)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= SLACK
    assert res.peak <= res.size and res.frames > 4 and staging.peak_bytes <= staging.max_bytes
    want = cpu_cache.clone()
    assert scatter_stored(want, lay, block_ids(ids, "cpu"), runs, skip=5, staging=Staging(4 << 20),
                          reservation=Reservation(16 << 20, "cpu"))
    assert torch.equal(cache.cpu().view(torch.int16), want.view(torch.int16))
    ref = gather_quantise(want, lay, block_ids(ids[:16 * RATIO], "cpu"), ratio=RATIO, precision=Precision(), layer=0)
    assert saved.k.is_pinned() and torch.equal(saved.k.view(torch.uint8), ref.k.view(torch.uint8))
    assert torch.equal(saved.v_scale, ref.v_scale)  # the errors are CUDA's reductions: close, maybe not the bits
    assert torch.allclose(saved.errors, ref.errors, rtol=1e-5, atol=0)
