"""Tile transposes of 2-byte elements, for the engine caches that keep K transposed in each block.

vLLM's CPU backend (``cpu_vec``) holds each (block, head)'s K as ``[head_dim, block_size]``;
kvwarm's layout is token-major, ``[heads, tokens, head_dim]``. numpy writes that transpose at
~8 GB/s here (one strided element at a time); the native module does it 8x8 at a time with
SSE2, with the GIL released (~4x faster: 0.03 against 0.14 ms for a kvwarm-ref layer of 2,048
tokens). Without the native module (a source install with no C compiler), :func:`transpose_k_into`
says so and the caller keeps its numpy path.
"""
from __future__ import annotations

import numpy as np

try:  # optional: a source install without a C compiler has numpy only
    from store.kernels import _fp8gather as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None


def native_transpose() -> bool:
    """Whether the native tile transpose is here (and with it :func:`transpose_k_into`)."""
    return _native is not None and hasattr(_native, "transpose_tiles")


def transpose_k_into(cache: np.ndarray, block_ids: np.ndarray, k: np.ndarray) -> bool:
    """Write ``k`` (``[heads, n * block, dim]``, 2-byte elements) into the K halves of engine blocks
    ``block_ids`` of ``cache`` (``[num_blocks, heads, 2 * block * dim]``, each (block, head) holding
    K as ``[dim, block]`` then V), transposed. ``False`` (nothing written) without the native module,
    or for elements of another size (an fp32 cache): the caller's numpy path writes those.

    Raises:
        ValueError: the shapes disagree, or a block id is outside the cache.
    """
    if not native_transpose() or k.itemsize != 2 or cache.itemsize != 2:
        return False
    nb, heads, width = cache.shape
    n = len(block_ids)
    if k.ndim != 3 or k.shape[0] != heads or n == 0 or k.shape[1] % n:
        raise ValueError(f"K of shape {k.shape} does not fill {n} blocks of a {cache.shape} cache")
    block, dim = k.shape[1] // n, k.shape[2]
    if width != 2 * block * dim:
        raise ValueError(f"K of {block}-token blocks of dim {dim} does not fit a cache row of {width} elements")
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= nb):
        raise ValueError(f"block ids {ids.min()}..{ids.max()} are outside the cache's {nb} blocks")
    tile = block * dim
    h = np.arange(heads, dtype=np.int64)[:, None]
    src_off = ((h * n + np.arange(n, dtype=np.int64)[None, :]) * tile).reshape(-1)
    dst_off = ((ids[None, :] * heads + h) * 2 * tile).reshape(-1)
    _native.transpose_tiles(np.ascontiguousarray(k), cache.reshape(-1), src_off, dst_off, block, dim)
    return True


def transpose_k_out(cache: np.ndarray, block_ids: np.ndarray, ratio: int, out: np.ndarray) -> bool:
    """The reverse of :func:`transpose_k_into`, for write-back: K of engine blocks ``block_ids`` of ``cache``
    (``ratio`` engine blocks per kvwarm block, in token order) into ``out``, ``[n, heads, ratio * block,
    dim]`` (token-major). ``False`` (nothing written) without the native module, or for elements of
    another size.

    Raises:
        ValueError: the shapes disagree, or a block id is outside the cache.
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    if not native_transpose() or out.itemsize != 2 or cache.itemsize != 2 or ids.size == 0:
        return False  # (no blocks: nothing to write, the caller's path makes the empty parts)
    nb, heads, width = cache.shape
    n = len(ids) // ratio if ratio > 0 else 0
    if n == 0 or len(ids) % ratio or out.ndim != 4 or out.shape[:2] != (n, heads) or out.shape[2] % ratio:
        raise ValueError(f"{len(ids)} engine blocks ({ratio} a kvwarm block) do not fill K of shape {out.shape}")
    block, dim = out.shape[2] // ratio, out.shape[3]
    if width != 2 * block * dim:
        raise ValueError(f"K of {block}-token blocks of dim {dim} does not fit a cache row of {width} elements")
    if ids.min() < 0 or ids.max() >= nb:
        raise ValueError(f"block ids {ids.min()}..{ids.max()} are outside the cache's {nb} blocks")
    tile = block * dim
    eng = ids.reshape(n, 1, ratio)
    h = np.arange(heads, dtype=np.int64).reshape(1, heads, 1)
    src_off = ((eng * heads + h) * 2 * tile).reshape(-1)  # K^T of each (engine block, head): [dim, block]
    j, r = np.arange(n, dtype=np.int64).reshape(n, 1, 1), np.arange(ratio, dtype=np.int64).reshape(1, 1, ratio)
    dst_off = (((j * heads + h) * ratio + r) * tile).reshape(-1)
    _native.transpose_tiles(cache.reshape(-1), out.reshape(-1), src_off, dst_off, dim, block)
    return True
