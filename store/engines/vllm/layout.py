"""The layout of the engine's KV tensors, detected from their shapes, strides and the attention ISA.

vLLM hands a connector one tensor per attention layer (``register_kv_caches``). What its
bytes mean depends on the backend, and vLLM has changed it more than once, so it is
detected, and anything not recognised is refused at start-up with the shape it had:

- ``cpu_vec``: the CPU backend (``CPU_ATTN``) with the ``vec``/``vec16`` ISAs. Per layer
  ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, contiguous; for each (block, head) the
  ``block_size * 2 * head_dim`` elements hold K *transposed*, ``[head_dim, block_size]``, then
  V, ``[block_size, head_dim]`` (vLLM's ``csrc/cpu/cpu_attn_vec.hpp``). The last dimension does
  **not** pack K and V side by side.
- ``cpu_permuted``: the CPU backend with another ISA (``amx`` packs K and V for its tiles): the
  same shape, and an in-block order read off vLLM's own kernel at start-up (see
  :func:`probe_inputs`, :func:`index_from_probe`): a permutation of ``(K|V, head, token, dim)``.
- ``split``: vLLM's CUDA backends since RFC #42082: the logical per-layer shape
  ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` with K in ``[..., :head_dim]`` and V in
  ``[..., head_dim:]``, whatever the strides (the kernels ``split`` the last dimension).
- ``kv_first``: the older flash-attention layout ``[2, num_blocks, block_size, kv_heads, head_dim]``.

Pure tensor maths, no vLLM: :mod:`store.engines.vllm.paging` moves blocks in and out by it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from store.errors import BadInputError

CPU_BACKEND = "CPU_ATTN"
VEC_ISAS = ("vec", "vec16")
KINDS = ("cpu_vec", "cpu_permuted", "split", "kv_first")
#: Probe digits are sent in base 256: every float dtype an engine uses holds 0..255 exactly.
DIGIT = 256


class UnsupportedLayout(BadInputError):
    """The engine's KV tensors are laid out in a way kvwarm does not know; the message shows them."""


@dataclass(frozen=True)
class EngineLayout:
    """How one engine's KV tensors hold blocks (every layer alike).

    Attributes:
        kind: one of :data:`KINDS`.
        num_blocks, num_kv_heads, block_size, head_dim: the geometry.
        dtype: the engine's KV dtype.
        index: ``cpu_permuted`` only: ``[2, kv_heads, block_size, head_dim]``, for K (0) and V (1) of
            each head, token and dim, its offset within one block's ``2 * kv_heads * block_size * head_dim``
            elements.
    """

    kind: str
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    index: torch.Tensor | None = None

    @property
    def block_elements(self) -> int:
        """Elements of one block of one layer (K and V of every head)."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.block_elements * self.dtype.itemsize

    @cached_property
    def index_runs(self) -> tuple[int, int]:
        """``cpu_permuted`` only: for K and V, the longest run ``L`` (a power of two dividing ``head_dim``) such
        that every ``L`` consecutive dims of a head and token lie at consecutive offsets, starting at a multiple
        of ``L``: the blocks can then be moved ``L`` elements at a time. 1 where no run is longer."""
        assert self.index is not None, "index_runs is for the cpu_permuted layout"
        return run_length(self.index[0]), run_length(self.index[1])


def _describe(tensors: Sequence[torch.Tensor]) -> str:
    t = tensors[0]
    return f"shape {list(t.shape)}, stride {list(t.stride())}, dtype {t.dtype}, {len(tensors)} layer(s)"


def detect_layout(tensors: Sequence[torch.Tensor], *, backend: str, isa: str | None, num_kv_heads: int,
                  head_dim: int, block_size: int, index: torch.Tensor | None = None) -> EngineLayout:
    """The layout of an engine's per-layer KV tensors.

    Args:
        tensors: one per attention layer, as ``register_kv_caches`` gives them.
        backend: the attention backend's name (``CPU_ATTN``, ``FLASH_ATTN``, ...).
        isa: the CPU backend's ISA for these layers (``vec``, ``vec16``, ``amx``...), else ``None``.
        num_kv_heads, head_dim, block_size: the KV cache spec vLLM allocated them for.
        index: for the CPU backend with an ISA other than ``vec``/``vec16``: the in-block order
            read off vLLM's kernel (:func:`index_from_probe`).

    Raises:
        UnsupportedLayout: layers that differ, an FP8 (or other one-byte) engine cache, a shape that
            is none of the known layouts, or a CPU ISA whose order was not probed. The message
            shows the shape, strides and dtype seen.
    """
    if not tensors:
        raise UnsupportedLayout("the engine registered no KV tensors (no attention layers?)")
    seen = _describe(tensors)
    first = tensors[0]
    if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype for t in tensors):
        raise UnsupportedLayout(f"the engine's KV tensors differ between layers ({seen} for the first); kvwarm "
                                "needs every layer alike (hybrid models are not supported)")
    if not first.dtype.is_floating_point or first.element_size() == 1:
        raise UnsupportedLayout(f"the engine's KV cache is {first.dtype} ({seen}): FP8 engine caches are not "
                                "supported; start vLLM with --kv-cache-dtype auto")
    H, B, D = num_kv_heads, block_size, head_dim
    geometry = dict(num_kv_heads=H, block_size=B, head_dim=D, dtype=first.dtype)
    if first.dim() == 4 and tuple(first.shape[1:]) == (H, B, 2 * D):
        nb = int(first.shape[0])
        if backend != CPU_BACKEND:
            return EngineLayout("split", nb, **geometry)
        if not first.is_contiguous():
            raise UnsupportedLayout(f"the CPU backend's KV tensors are not contiguous ({seen})")
        if isa in VEC_ISAS:
            return EngineLayout("cpu_vec", nb, **geometry)
        if index is None or tuple(index.shape) != (2, H, B, D):
            raise UnsupportedLayout(f"the CPU backend's ISA {isa!r} lays blocks out in an order kvwarm did not "
                                    f"read ({seen})")
        return EngineLayout("cpu_permuted", nb, **geometry, index=index)
    if first.dim() == 5 and first.shape[0] == 2 and tuple(first.shape[2:]) == (B, H, D):
        return EngineLayout("kv_first", int(first.shape[1]), **geometry)
    raise UnsupportedLayout(f"unknown KV cache layout from backend {backend!r}: {seen}; kvwarm knows "
                            f"[num_blocks, {H}, {B}, {2 * D}] and [2, num_blocks, {B}, {H}, {D}] "
                            f"(kv_heads {H}, block_size {B}, head_dim {D})")


def run_length(index: torch.Tensor) -> int:
    """The longest power-of-two ``L`` dividing the last dimension of ``index`` (offsets) such that each aligned
    group of ``L`` entries along it is ``start, start + 1, ...`` with ``start`` a multiple of ``L``."""
    dim, run = index.shape[-1], 1
    while dim % (2 * run) == 0:
        groups = index.reshape(-1, 2 * run)
        if not (bool((groups[:, 0] % (2 * run) == 0).all())
                and torch.equal(groups - groups[:, :1], torch.arange(2 * run).expand_as(groups))):
            break
        run *= 2
    return run


def vec_index(num_kv_heads: int, block_size: int, head_dim: int) -> torch.Tensor:
    """The ``cpu_vec`` order as an index (:attr:`EngineLayout.index`): per head, K^T ``[D, B]`` then V ``[B, D]``."""
    H, B, D = num_kv_heads, block_size, head_dim
    h = torch.arange(H).view(H, 1, 1) * (2 * B * D)
    t = torch.arange(B).view(1, B, 1)
    d = torch.arange(D).view(1, 1, D)
    return torch.stack([h + d * B + t, h + B * D + t * D + d])


def probe_inputs(num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What to write through the engine's own cache kernel to learn its in-block order.

    Each element of K and V (``[tokens, heads, dim]``, as the kernel takes them) carries its
    position code ``((kv * H + h) * B + t) * D + d``, one base-256 digit per call. Write each
    pair into a zeroed scratch block with slots ``0..B-1`` and give the blocks, in order, to
    :func:`index_from_probe`.
    """
    H, B, D = num_kv_heads, block_size, head_dim
    code = torch.arange(2 * H * B * D, dtype=torch.int64).view(2, H, B, D)
    digits = max(1, -(-(2 * H * B * D - 1).bit_length() // 8))
    out = []
    for i in range(digits):
        part = ((code // DIGIT**i) % DIGIT).to(dtype)
        out.append((part[0].transpose(0, 1).contiguous(), part[1].transpose(0, 1).contiguous()))
    return out


def index_from_probe(blocks: Sequence[torch.Tensor], num_kv_heads: int, block_size: int,
                     head_dim: int) -> torch.Tensor:
    """The in-block order (:attr:`EngineLayout.index`) from the scratch blocks of :func:`probe_inputs`.

    Raises:
        UnsupportedLayout: what the kernel wrote is not a permutation of the positions (it
            transforms values, e.g. quantises them, or drops some).
    """
    H, B, D = num_kv_heads, block_size, head_dim
    n = 2 * H * B * D
    code = torch.zeros(n, dtype=torch.int64)
    for i, block in enumerate(blocks):
        flat = block.reshape(-1)
        if flat.numel() != n:
            raise UnsupportedLayout(f"a probe block has {flat.numel()} elements, expected {n}")
        code += flat.to(torch.int64) * DIGIT**i
    if not torch.equal(torch.sort(code).values, torch.arange(n)):
        raise UnsupportedLayout("the engine's cache kernel does not store K and V as a permutation of their "
                                "elements; kvwarm cannot write its blocks")
    index = torch.empty(n, dtype=torch.int64)
    index[code] = torch.arange(n)
    return index.view(2, H, B, D)
