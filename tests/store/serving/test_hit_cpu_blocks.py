"""A hit dequantised straight into vLLM's CPU cache blocks (``cpu_vec``): the bits of ``dequantized`` then
``write_layer``, which is the path it replaces on a CPU worker (:meth:`store.serving.hit.LoaderHit.into_cpu_blocks`,
the native ``gather_vec``), for every layer stored FP8, layers kept in bf16, a bf16 store, tensor-parallel shares,
pipeline stages' layers, a first engine block already cached, engine blocks smaller and larger than kvwarm's, and
the plain loops that CPUs without AVX2 run; stores in fp16 are left to the caller.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from store.config import parse_config
from store.engines.vllm.paging import write_layer
from store.kernels.table import native_isa, pin_native_isa
from store.serving.hit import LoaderHit
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.store.kernels.engine_caches import layout, random_cache
from tests.store.pool_workers import ACME, TINY, prompt, tiny_model, write_prefix

BS = 16  # kvwarm's block

pytestmark = pytest.mark.skipif(native_isa() is None, reason="the native module is not built (no C compiler)")


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.bfloat16)[0]


@contextmanager
def _hit(tmp_path, model, kv_cache: dict) -> Iterator[LoaderHit]:
    """The hit of a 4-block prefix stored with ``kv_cache``'s settings (released, its loader closed, after)."""
    cfg = parse_config({"kv_cache": {"block_size": BS, **kv_cache}})
    ids = prompt(4 * BS + 2, seed=3)
    store = Store.open(f"file://{tmp_path}/nvme", cfg)
    write_prefix(store, cfg, model, ids[: 4 * BS])
    store.close()
    loader = KVLoader(f"file://{tmp_path}/nvme", tenant=ACME, model=TINY, pool_bytes=1 << 30, config=cfg,
                      pool_dir=tmp_path / "pool")
    hit = loader.lookup(ids)
    try:
        assert hit is not None and hit.tokens == 4 * BS
        yield hit
    finally:
        if hit is not None:
            hit.release()
        loader.close()


def _check(hit, *, eb: int, first: int, tokens: int, skip: int, layers, heads) -> None:
    h = 2 if heads is None else heads.stop - heads.start
    chosen = [0, 1] if layers is None else layers
    lay = layout("cpu_vec", blocks=24, heads=h, block=eb, dim=16, dtype=torch.bfloat16)
    n = (tokens - skip) // eb
    engine = [(7 * i + 5) % 24 for i in range(n)]  # scattered, none twice
    got = [random_cache(lay, seed=10 + i) for i in range(len(chosen))]
    want = [c.clone() for c in got]
    assert hit.into_cpu_blocks(got, lay, engine, first_block=first, tokens=tokens, layers=layers, heads=heads,
                               skip=skip)
    kv = hit.dequantized(torch.bfloat16, first_block=first, tokens=tokens, layers=layers, heads=heads)
    for i in range(len(chosen)):
        write_layer(want[i], lay, engine, kv[2 * i][:, skip:], kv[2 * i + 1][:, skip:])
        assert torch.equal(got[i].view(torch.int16), want[i].view(torch.int16)), f"layer {chosen[i]}"


@pytest.mark.parametrize("isa", ["best", "scalar"])
@pytest.mark.parametrize("kv_cache", [{"compression": "fp8"}, {"compression": "fp8", "keep_layers": []},
                                      {"compression": "bf16"}], ids=["fp8-keeps-a-layer", "fp8-every-layer", "bf16"])
def test_blocks_written_natively_are_what_dequantized_and_write_layer_wrote(tmp_path, model, kv_cache, isa) -> None:
    with _hit(tmp_path, model, kv_cache) as hit:
        pin_native_isa(isa)
        try:
            for eb, first, tokens, skip in ((8, 0, 4 * BS, 0), (8, 1, 3 * BS - 8, 8), (32, 0, 4 * BS, 32),
                                            (16, 2, 2 * BS, 0)):
                for layers, heads in ((None, None), ([1], slice(1, 2)), ([1, 0], slice(0, 1))):
                    _check(hit, eb=eb, first=first, tokens=tokens, skip=skip, layers=layers, heads=heads)
        finally:
            pin_native_isa("best")


@pytest.mark.parametrize("kv_cache", [{"compression": "fp16"}, {"compression": "fp8", "keep_dtype": "fp16"}])
def test_stores_the_native_pass_does_not_cover_are_left_to_the_caller(tmp_path, model, kv_cache) -> None:
    with _hit(tmp_path, model, kv_cache) as hit:
        lay = layout("cpu_vec", blocks=24, heads=2, block=8, dim=16, dtype=torch.bfloat16)
        caches = [random_cache(lay, seed=i) for i in range(2)]
        before = [c.clone() for c in caches]
        assert not hit.into_cpu_blocks(caches, lay, list(range(8)), first_block=0, tokens=4 * BS)
        assert all(torch.equal(a, b) for a, b in zip(caches, before))
        split = layout("split", blocks=24, heads=2, block=8, dim=16, dtype=torch.bfloat16)
        assert not hit.into_cpu_blocks(caches, split, list(range(8)), first_block=0, tokens=4 * BS)


def test_engine_blocks_outside_the_cache_or_a_range_that_does_not_fill_them_are_refused(tmp_path, model) -> None:
    with _hit(tmp_path, model, {"compression": "fp8"}) as hit:
        lay = layout("cpu_vec", blocks=6, heads=2, block=8, dim=16, dtype=torch.bfloat16)
        caches = [random_cache(lay, seed=i) for i in range(2)]
        before = [c.clone() for c in caches]
        with pytest.raises(ValueError, match="outside the cache's 6 blocks"):
            hit.into_cpu_blocks(caches, lay, [0, 1, 2, 3, 4, 5, 6, 7], first_block=0, tokens=4 * BS)
        with pytest.raises(ValueError, match="do not fill 3 engine blocks"):
            hit.into_cpu_blocks(caches, lay, [0, 1, 2], first_block=0, tokens=4 * BS)
        with pytest.raises(ValueError, match="outside this hit"):
            hit.into_cpu_blocks(caches, lay, [0, 1], first_block=3, tokens=2 * BS)
        assert all(torch.equal(a, b) for a, b in zip(caches, before))
