"""Detecting the engine's KV layout, and reading the CPU backend's in-block order off its kernel."""
from __future__ import annotations

import pytest
import torch

from store.engines.vllm.layout import (
    UnsupportedLayout,
    detect_layout,
    index_from_probe,
    probe_inputs,
    vec_index,
)

H, B, D = 2, 128, 32


def cpu_cache(nb: int = 16, h: int = H, b: int = B, d: int = D, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(nb, h, b, 2 * d, dtype=dtype)


def detect(tensors, backend="CPU_ATTN", isa="vec", **kw):
    geometry = dict(num_kv_heads=H, head_dim=D, block_size=B)
    geometry.update(kw)
    return detect_layout(tensors, backend=backend, isa=isa, **geometry)


def test_the_cpu_backend_with_vec_isas() -> None:
    for isa in ("vec", "vec16"):
        lay = detect([cpu_cache(), cpu_cache()], isa=isa)
        assert (lay.kind, lay.num_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim) == ("cpu_vec", 16, H, B, D)
        assert lay.block_bytes == 2 * H * B * D * 2


def test_another_cpu_isa_needs_its_probed_order() -> None:
    with pytest.raises(UnsupportedLayout, match=r"ISA 'amx'.*shape \[16, 2, 128, 64\]"):
        detect([cpu_cache()], isa="amx")
    perm = torch.randperm(2 * H * B * D).view(2, H, B, D)
    lay = detect([cpu_cache()], isa="amx", index=perm)
    assert lay.kind == "cpu_permuted" and torch.equal(lay.index, perm)


def test_cuda_backends_split_the_last_dim_and_the_old_layout_puts_kv_first() -> None:
    logical = torch.zeros(16, B, H, 2 * D).transpose(1, 2)  # [nb, H, B, 2D] with NHD strides
    assert detect([logical], backend="FLASH_ATTN", isa=None).kind == "split"
    old = torch.zeros(2, 16, B, H, D)
    lay = detect([old, old], backend="FLASH_ATTN", isa=None)
    assert (lay.kind, lay.num_blocks) == ("kv_first", 16)


@pytest.mark.parametrize("tensors, must_say", [
    ([torch.zeros(16, H, B, 3 * D, dtype=torch.bfloat16)], "shape [16, 2, 128, 96]"),
    ([torch.zeros(16, 4, B, 2 * D, dtype=torch.bfloat16)], "kv_heads 2"),
    ([torch.zeros(16, H, B, 2 * D, dtype=torch.uint8)], "FP8 engine caches are not supported"),
    ([torch.zeros(16, H, B, 2 * D).to(torch.float8_e4m3fn)], "--kv-cache-dtype auto"),
    ([cpu_cache(), cpu_cache(nb=8)], "differ between layers"),
    ([], "no KV tensors"),
    ([torch.zeros(16, H, 2 * D, B, dtype=torch.bfloat16).transpose(2, 3)], "not contiguous"),
])
def test_unknown_layouts_are_refused_naming_what_was_seen(tensors, must_say) -> None:
    with pytest.raises(UnsupportedLayout) as err:
        detect(tensors)
    assert must_say in str(err.value)


def fake_vec_kernel(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
    """What vLLM's VEC reshape_and_cache does to one block (from csrc/cpu/cpu_attn_vec.hpp):
    per head, K written column-major ([D, B]) then V row-major ([B, D])."""
    h, bs, d2 = block.shape
    d = d2 // 2
    flat = block.view(h, bs * d2)
    flat[:, : bs * d] = key.permute(1, 2, 0).reshape(h, d * bs)  # [T, H, D] -> [H, D, T]
    flat[:, bs * d :] = value.permute(1, 0, 2).reshape(h, bs * d)


@pytest.mark.parametrize("h, b, d", [(2, 128, 32), (4, 256, 64), (2, 96, 64)])
def test_the_probe_recovers_the_vec_order_exactly(h: int, b: int, d: int) -> None:
    blocks = []
    for key, value in probe_inputs(h, b, d, torch.bfloat16):
        assert key.shape == (b, h, d) and key.dtype == torch.bfloat16
        block = torch.zeros(h, b, 2 * d, dtype=torch.bfloat16)
        fake_vec_kernel(key, value, block)
        blocks.append(block)
    assert torch.equal(index_from_probe(blocks, h, b, d), vec_index(h, b, d))


def test_vec_index_is_the_documented_formula() -> None:
    # per (block, head): flat = kv[b, h].reshape(-1); K = flat[:B*D].view(D, B).T; V = flat[B*D:].view(B, D)
    idx = vec_index(H, B, D)
    h, t, d = 1, 5, 7
    assert idx[0, h, t, d] == h * 2 * B * D + d * B + t
    assert idx[1, h, t, d] == h * 2 * B * D + B * D + t * D + d


def test_the_probe_recovers_any_permutation_and_refuses_a_kernel_that_is_not_one() -> None:
    h, b, d = 2, 32, 32
    perm = torch.randperm(2 * h * b * d, generator=torch.Generator().manual_seed(3))

    def run(kernel):
        blocks = []
        for key, value in probe_inputs(h, b, d, torch.float16):
            src = torch.stack([key.transpose(0, 1), value.transpose(0, 1)]).reshape(-1)  # [2, H, T, D]
            block = torch.zeros(2 * h * b * d, dtype=torch.float16)
            kernel(block, src)
            blocks.append(block)
        return index_from_probe(blocks, h, b, d)

    def permuted(block, src):
        block[perm] = src

    assert torch.equal(run(permuted).reshape(-1), perm)

    def lossy(block, src):  # a kernel that scales values (an FP8 cache would) is no permutation
        block[perm] = src * 0.5

    with pytest.raises(UnsupportedLayout, match="not .* a permutation"):
        run(lossy)
