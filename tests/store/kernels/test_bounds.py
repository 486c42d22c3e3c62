"""Device and pinned memory stay within their bounds over 1,000 loads and saves of mixed sizes.

One reservation (as a vLLM worker has per device) and one bounded staging serve every load and
save, of 1 block to many times what the reservation holds at once (seeded sizes; FP8 with per-head and
with per-group scales, and a layer mixed precision keeps in fp16), through the real kernels with the CPU
as the device. After each, the reservation's high-water mark is within its size,
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

H, B, D, NB, RATIO = 2, 4, 8, 128, 2
TOKENS = RATIO * B  # a kvwarm block's tokens
OPS = 1000
MOST_BLOCKS = 60


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_a_thousand_loads_and_saves_of_mixed_sizes_stay_within_the_reservation_and_the_pinned_cap() -> None:
    rng = random.Random(33)
    keep = Precision(keep_layers=(1,), keep_dtype="fp16")  # FP8 layer 0 (per-head scales), fp16 layer 1
    grouped = Precision(granularity="head_group", group_tokens=3)  # 8-token blocks: 3 groups, the last short
    kinds = {"fp8": (keep, 0), "fp16": (keep, 1), "group": (grouped, 0)}  # precision, layer
    lay = layout("split", blocks=NB, heads=H, block=B, dim=D, dtype=torch.bfloat16)
    res = save_reservation(3, grouped, H, TOKENS, D, torch.bfloat16)  # a save's chunk: 3 kvwarm blocks at most
    staging = Staging(SLOTS * 700)  # a piece: at most 700 bytes (a stored part is 128): many pieces a load
    save_step = chunk_blocks(res, save_block_bytes(keep, H, TOKENS, D, torch.bfloat16), "write-back")
    load_step = chunk_blocks(res, load_block_bytes(H, TOKENS, D, torch.float8_e4m3fn, torch.bfloat16, 3), "load")
    assert MOST_BLOCKS >= 10 * save_step and MOST_BLOCKS >= 5 * load_step  # well over what one chunk holds
    pool = {kind: stored_parts(MOST_BLOCKS, H, TOKENS, D, precision, seed=i, layer=layer)
            for i, (kind, (precision, layer)) in enumerate(kinds.items())}
    cache = random_cache(lay, seed=1)
    want = cache.clone()
    done = {"load": 0, "save": 0}
    for op in range(OPS):
        n = rng.randint(1, MOST_BLOCKS)
        kind = rng.choice(list(kinds))
        precision, layer = kinds[kind]
        g = precision.group_tokens
        if op % 2 == 0:  # a load of n blocks, from a random engine block of the first
            runs = [run[:n] for run in pool[kind]]
            skip = rng.randrange(RATIO * n)
            ids = block_ids(rng.sample(range(NB), rng.randint(1, min(NB, RATIO * n - skip))), "cpu")
            assert scatter_stored(cache, lay, ids, runs, skip=skip, staging=staging, reservation=res, group_tokens=g)
            (k, ks), (v, vs) = stacked(runs[0]), stacked(runs[1])
            dequantise_scatter(want, lay, ids, k=k, k_scale=ks, v=v, v_scale=vs, skip=skip, group_tokens=g)
            assert torch.equal(bits(cache), bits(want)), f"load {op}"
            done["load"] += 1
        else:  # a save of n blocks' engine blocks, anywhere in the cache
            ids = block_ids(rng.sample(range(NB), RATIO * n), "cpu")
            got = quantise_to_host(cache, lay, ids, ratio=RATIO, precision=precision, layer=layer, reservation=res)
            ref = gather_quantise(cache, lay, ids, ratio=RATIO, precision=precision, layer=layer)
            for a, b in ((got.k, ref.k), (got.k_scale, ref.k_scale), (got.v, ref.v), (got.v_scale, ref.v_scale),
                         (got.errors, ref.errors)):
                assert (a is None) == (b is None) and (a is None or torch.equal(bits(a), bits(b))), f"save {op}"
            done["save"] += 1
        assert res.peak <= res.size, f"the reservation's high-water mark passed its size at op {op}"
        assert staging.peak_bytes <= staging.max_bytes and staging.pinned_bytes <= staging.max_bytes
    assert done == {"load": OPS // 2, "save": OPS // 2}
    assert res.frames > OPS  # the big ones went through in chunks, all in the one buffer
    staging.close()
