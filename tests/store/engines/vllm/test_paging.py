"""Writing kvwarm's K/V into engine blocks and reading them back, for every known layout."""
from __future__ import annotations

import pytest
import torch

from store.engines.vllm.layout import EngineLayout, vec_index
from store.engines.vllm.paging import read_layer, write_layer

H, B, D, NB = 2, 32, 16, 12
IDS = [7, 2, 9]  # engine block ids are neither ordered nor contiguous


def kv(n_blocks: int, seed: int = 0, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (H, n_blocks * B, D)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def layout(kind: str, dtype=torch.bfloat16) -> EngineLayout:
    index = vec_index(H, B, D)[:, :, :, :].flip(-1).contiguous() if kind == "cpu_permuted" else None
    return EngineLayout(kind, NB, H, B, D, dtype, index)


def cache_for(kind: str, dtype=torch.bfloat16) -> torch.Tensor:
    if kind == "kv_first":
        return torch.full((2, NB, B, H, D), -9.0, dtype=dtype)
    if kind == "split":
        return torch.full((NB, B, H, 2 * D), -9.0, dtype=dtype).transpose(1, 2)  # CUDA's NHD strides
    return torch.full((NB, H, B, 2 * D), -9.0, dtype=dtype)


@pytest.mark.parametrize("kind", ["cpu_vec", "cpu_permuted", "split", "kv_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])  # numpy bit copies, and torch's
def test_round_trip_touches_only_the_given_blocks(kind: str, dtype: torch.dtype) -> None:
    cache, lay = cache_for(kind, dtype), layout(kind, dtype)
    k, v = kv(len(IDS), dtype=dtype)
    write_layer(cache, lay, IDS, k, v)
    k2, v2 = read_layer(cache, lay, IDS)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    others = [b for b in range(NB) if b not in IDS]
    blocks = cache[:, others] if kind == "kv_first" else cache[others]
    assert bool((blocks == -9.0).all())


def test_cpu_vec_holds_k_transposed_then_v_per_block_and_head() -> None:
    cache, lay = cache_for("cpu_vec"), layout("cpu_vec")
    k, v = kv(len(IDS), seed=1)
    write_layer(cache, lay, IDS, k, v)
    for j, b in enumerate(IDS):
        for h in range(H):
            flat = cache[b, h].reshape(-1)
            assert torch.equal(flat[: B * D].view(D, B).T, k[h, j * B : (j + 1) * B])
            assert torch.equal(flat[B * D :].view(B, D), v[h, j * B : (j + 1) * B])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_the_permuted_path_with_the_vec_order_writes_what_the_vec_path_writes(dtype: torch.dtype) -> None:
    a, b = cache_for("cpu_vec", dtype), cache_for("cpu_vec", dtype)
    k, v = kv(len(IDS), seed=2, dtype=dtype)
    write_layer(a, layout("cpu_vec", dtype), IDS, k, v)
    write_layer(b, EngineLayout("cpu_permuted", NB, H, B, D, dtype, vec_index(H, B, D)), IDS, k, v)
    assert torch.equal(a, b)


def test_a_slice_of_a_longer_run_is_written_as_it_is() -> None:
    cache, lay = cache_for("cpu_vec"), layout("cpu_vec")
    k, v = kv(3, seed=4)
    write_layer(cache, lay, [3, 5], k[:, B:], v[:, B:])  # what a load from the middle of a hit passes
    k2, v2 = read_layer(cache, lay, [3, 5])
    assert torch.equal(k2, k[:, B:]) and torch.equal(v2, v[:, B:])


def test_split_holds_k_then_v_in_the_last_dim() -> None:
    cache, lay = cache_for("split"), layout("split")
    k, v = kv(1, seed=3)
    write_layer(cache, lay, [4], k, v)
    assert torch.equal(cache[4, :, :, :D], k) and torch.equal(cache[4, :, :, D:], v)


def test_values_are_converted_to_the_engine_dtype_and_bad_shapes_refused() -> None:
    cache, lay = cache_for("cpu_vec", torch.float16), layout("cpu_vec", torch.float16)
    k, v = kv(2, dtype=torch.float32)
    write_layer(cache, lay, [0, 1], k, v)
    assert torch.equal(read_layer(cache, lay, [0, 1])[0], k.to(torch.float16))
    with pytest.raises(ValueError, match="do not fill 3 engine blocks"):
        write_layer(cache, lay, [0, 1, 2], k, v)


def test_block_runs_cover_the_ids_in_order() -> None:
    from store.engines.vllm.paging import block_runs

    assert block_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert block_runs([]) == []


def test_blocks_taken_to_host_in_runs_are_the_blocks() -> None:
    from store.engines.vllm.layout import EngineLayout
    from store.engines.vllm.paging import take_blocks

    for kind, shape in (("split", (10, 2, 4, 16)), ("kv_first", (2, 10, 4, 2, 8))):
        cache = torch.randn(shape).to(torch.bfloat16)
        layout = EngineLayout(kind, 10, 2, 4, 8, torch.bfloat16)
        ids = [3, 4, 5, 1, 8, 9]
        got = take_blocks(cache, layout, ids, host=True)
        want = cache.index_select(1 if kind == "kv_first" else 0, torch.tensor(ids))
        assert torch.equal(got, want)
