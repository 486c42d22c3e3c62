"""Device and pinned memory stay within their bounds over 1,000 loads and saves of mixed sizes.

One reservation (as a vLLM worker has per device) and one bounded staging serve every load and
save, of 1 block to many times what the reservation holds at once (seeded sizes), through the real
kernels with the CPU as the device. After each, the reservation's high-water mark is within its size,
the staging's pinned bytes within their cap, and the results are the whole-batch kernels' bits (which
test_scatter.py and test_gather.py hold to the codec's).
"""
from __future__ import annotations

import random

import torch

from store.format.precision import Precision
from store.kernels.chunks import chunk_blocks, load_block_bytes, quantise_to_host, save_block_bytes, scatter_stored
from store.kernels.gather import block_ids, gather_quantise
from store.kernels.scatter import dequantise_scatter
from store.kernels.staging import SLOTS, Staging
from tests.store.kernels.chunking import save_reservation, stacked, stored_parts
from tests.store.kernels.engine_caches import layout, random_cache

H, B, D, NB, RATIO = 2, 4, 8, 96, 2
TOKENS = RATIO * B  # a kvwarm block's tokens
OPS = 1000
MOST_BLOCKS = 40


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_a_thousand_loads_and_saves_of_mixed_sizes_stay_within_the_reservation_and_the_pinned_cap() -> None:
    rng = random.Random(33)
    precision = Precision(keep_layers=(1,), keep_dtype="fp16")  # FP8 layer 0, fp16 layer 1
    lay = layout("split", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16)
    res = save_reservation(3, precision, H, TOKENS, D, torch.bfloat16)  # a save's chunk: 3 kvwarm blocks
    staging = Staging(SLOTS * 700)  # a piece: at most 700 bytes (a stored part is 128): many pieces a load
    save_step = chunk_blocks(res, save_block_bytes(precision, H, TOKENS, D, torch.bfloat16), "write-back")
    load_step = chunk_blocks(res, load_block_bytes(H, TOKENS, D, torch.float8_e4m3fn, torch.bfloat16), "load")
    assert MOST_BLOCKS >= 10 * save_step and MOST_BLOCKS >= 5 * load_step  # well over what one chunk holds
    pool = {layer: stored_parts(MOST_BLOCKS, H, TOKENS, D, precision, seed=layer) for layer in (0, 1)}
    cache = random_cache(lay, seed=1)
    want = cache.clone()
    loads = saves = 0
    for op in range(OPS):
        n = rng.randint(1, MOST_BLOCKS)
        layer = rng.randint(0, 1)
        if op % 2 == 0:  # a load of n blocks, from a random engine block of the first
            runs = [run[:n] for run in pool[layer]]
            skip = rng.randrange(RATIO * n)
            ids = block_ids(rng.sample(range(NB), rng.randint(1, min(NB, RATIO * n - skip))), "cpu")
            assert scatter_stored(cache, lay, ids, runs, skip=skip, staging=staging, reservation=res)
            (k, ks), (v, vs) = stacked(runs[0]), stacked(runs[1])
            dequantise_scatter(want, lay, ids, k=k, k_scale=ks, v=v, v_scale=vs, skip=skip)
            assert torch.equal(bits(cache), bits(want)), f"load {op}"
            loads += 1
        else:  # a save of n blocks' engine blocks, anywhere in the cache
            ids = block_ids(rng.sample(range(NB), RATIO * n), "cpu")
            got = quantise_to_host(cache, lay, ids, ratio=RATIO, precision=precision, layer=layer, reservation=res)
            ref = gather_quantise(cache, lay, ids, ratio=RATIO, precision=precision, layer=layer)
            for a, b in ((got.k, ref.k), (got.k_scale, ref.k_scale), (got.v, ref.v), (got.v_scale, ref.v_scale),
                         (got.errors, ref.errors)):
                assert (a is None) == (b is None) and (a is None or torch.equal(bits(a), bits(b))), f"save {op}"
            saves += 1
        assert res.peak <= res.size, f"the reservation's high-water mark passed its size at op {op}"
        assert staging.peak_bytes <= staging.max_bytes and staging.pinned_bytes <= staging.max_bytes
    assert loads == saves == OPS // 2
    assert res.frames > OPS  # the big ones went through in chunks, all in the one buffer
    staging.close()
