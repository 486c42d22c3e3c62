"""FP8 dequantisation by table: per head, the 256 possible results, then one gather.

An FP8 (e4m3) byte dequantised with a per-head scale has 256 possible values per head.
:func:`tables` computes them with the reference arithmetic of
:func:`store.format.precision.dequantize` (``fp32(value) * scale``, rounded once to the output
dtype), so a gather through them gives the reference bits by construction.

The gather itself is the native module ``store.kernels._fp8gather`` (built from
``store/kernels/_fp8gather.c`` at install; AVX-512 or AVX2 where the CPU has it, streaming
stores into new memory) when it is there, numpy's ``take`` otherwise. :func:`gather_parts` runs every
head of one stored part; :func:`gather_payloads` every part of whole snapshot payloads
straight from their mappings into the final ``[parts, heads, tokens, dim]`` layout: one
native call for the FP8 layers, one for the layers kept unquantised (plain copies), over
every layer and head or over a share of them (a pipeline stage's layers, a tensor-parallel
rank's heads: the other bytes are not read).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
import torch

from store.format.runs import NP_SAME_SIZE
from store.kernels import memory

if TYPE_CHECKING:
    from store.format.runs import PayloadPlan

try:  # optional: a source install without a C compiler has numpy only
    from store.kernels import _fp8gather as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
_FP8_NP = _FP8_VALUES.numpy()
#: output dtypes whose tables the native module makes itself (bf16 with PyTorch's rounding, fp32)
_TABLES_IN_C = (torch.bfloat16, torch.float32)


def native_isa() -> str | None:
    """The instruction set of the native gather (``"avx512bw"``, ``"avx2"``, ``"scalar"``), or ``None`` when
    the module was not built (numpy is used then: the same bits, slower)."""
    return None if _native is None else _native.isa()


def pin_native_isa(name: str) -> str | None:
    """Pin the native gather's (and FP8 quantiser's) instruction set: ``"scalar"`` (the plain loops, what CPUs without
    AVX2 run) or ``"best"`` (the best this CPU has, the default). Returns the one in use, ``None``
    without the native module. For tests and benches: not thread-safe against running gathers.

    Raises:
        ValueError: ``name`` is neither ``"scalar"`` nor ``"best"``.
    """
    if name not in ("scalar", "best"):
        raise ValueError(f"unknown instruction set {name!r}: use 'scalar' or 'best'")
    return None if _native is None else _native.use_isa(name)


def tables(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """For each scale, the output value of every FP8 byte: ``[*scale.shape, 256]`` in ``dtype``."""
    return (_FP8_VALUES * scale.to(torch.float32)[..., None]).to(dtype)


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same size as ``dtype`` (2 or 4 bytes): copies and gathers of its bits."""
    return {2: torch.int16, 4: torch.int32}[dtype.itemsize]


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def gather_parts(out: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor) -> bool:
    """``out[h] = table_h[stored[h]]`` for each head ``h`` of one CPU part ``[heads, tokens, dim]``.

    ``stored`` is FP8 and ``scale`` one fp32 value per head. Returns ``False``, writing
    nothing, where this does not apply (another device, dtype or scale shape, a head whose
    ``[tokens, dim]`` is not contiguous in ``out``, or shapes that differ).
    """
    if not (out.device.type == "cpu" and stored.device.type == "cpu" and stored.dtype == torch.float8_e4m3fn
            and scale.dim() == 1 and out.element_size() in NP_SAME_SIZE and out.shape == stored.shape
            and scale.shape[0] == out.shape[0]):
        return False
    if out.numel() and (out.stride(-1) != 1 or out.stride(-2) != out.shape[-1]):
        return False
    if stored.numel() and (stored.stride(-1) != 1 or stored.stride(-2) != stored.shape[-1]):
        stored = stored.contiguous()
    heads = out.shape[0]
    lut = tables(scale, out.dtype).view(bits_dtype(out.dtype))
    if _native is None:
        idx = stored.view(torch.uint8).numpy()
        dst = out.view(bits_dtype(out.dtype)).numpy()
        lnp = lut.numpy()
        for h in range(heads):
            # mode="clip": indices are bytes, always in range; "raise" would buffer the output.
            np.take(lnp[h], idx[h], out=dst[h], mode="clip")
        return True
    count = out.shape[1] * out.shape[2]
    if count == 0:
        return True
    esize = out.element_size()
    src = stored.data_ptr() + np.arange(heads, dtype=np.uint64) * np.uint64(stored.stride(0))
    dst = out.data_ptr() + np.arange(heads, dtype=np.uint64) * np.uint64(out.stride(0) * esize)
    _native.gather(src, dst, np.full(heads, count, dtype=np.uint64), lut.numpy(), esize)
    return True


class _Jobs(NamedTuple):
    """Where each native job of a payload plan reads and writes, relative to a payload's
    start and to the output's rows ``(part, head)``; computed once per plan."""

    src: np.ndarray  # [J] uint64: byte offset in a payload of FP8 job j (one head of one part)
    scale: np.ndarray  # [J] uint64: byte offset of its fp32 scale
    rows: np.ndarray  # [J] uint64: its output row, part * heads + head
    copy_src: np.ndarray  # [C] uint64: byte offset of copy job c (one head of K or V of a plain layer)
    copy_rows: np.ndarray  # [C] uint64
    end: int  # one past the last payload byte any job reads


def _jobs(plan: "PayloadPlan") -> _Jobs:
    cached = plan.__dict__.get("_jobs")
    if cached is not None:
        return cached
    heads, bs, dim = plan.shape
    h = np.arange(heads, dtype=np.uint64)
    src, scales, rows, csrc, crows = [], [], [], [], []
    group = plan.fp8
    if group is not None:
        for j, (d, sc) in enumerate(zip(group.data, group.scales)):
            part = 2 * group.layers[j // 2] + j % 2
            src.append(np.uint64(d) + h * np.uint64(bs * dim))
            scales.append(np.uint64(sc) + h * np.uint64(4))
            rows.append(np.uint64(part * heads) + h)
    esize = plan.plain_dtype.itemsize if plan.plain_dtype is not None else 0
    for run in plan.plain:
        for r in range(run.count):
            layer = plan.plain_layers[run.first + r]
            for kv in (0, 1):
                off = run.base + r * run.layer_step + kv * run.kv_step
                csrc.append(np.uint64(off) + h * np.uint64(bs * dim * esize))
                crows.append(np.uint64((2 * layer + kv) * heads) + h)

    def cat(xs: list) -> np.ndarray:
        return np.concatenate(xs).astype(np.uint64) if xs else np.zeros(0, dtype=np.uint64)
    jobs = _Jobs(cat(src), cat(scales), cat(rows), cat(csrc), cat(crows), 0)
    ends = [int(jobs.src.max()) + bs * dim if len(jobs.src) else 0,
            int(jobs.scale.max()) + 4 if len(jobs.scale) else 0,
            int(jobs.copy_src.max()) + bs * dim * esize if len(jobs.copy_src) else 0]
    jobs = jobs._replace(end=max(ends))
    object.__setattr__(plan, "_jobs", jobs)  # a cache on the (frozen) plan, like the plan on its layout
    return jobs


def _selected(plan: "PayloadPlan", layers: tuple[int, ...] | None, heads: tuple[int, int] | None) -> _Jobs:
    """The jobs of :func:`_jobs` that read ``layers`` (in this order) and heads ``[start, stop)``, their
    output rows renumbered ``(2 * position of the layer + K|V) * (stop - start) + head - start``.

    A job is one head of one part of one block: a job not selected is never run, so the bytes
    of the other layers and heads are not read at all (a tensor-parallel rank reads its share).
    """
    full = _jobs(plan)
    if layers is None and heads is None:
        return full
    cache = plan.__dict__.get("_selected")
    if cache is None:
        cache = {}
        object.__setattr__(plan, "_selected", cache)  # a cache on the (frozen) plan, as _jobs is
    key = (layers, heads)
    got = cache.get(key)
    if got is not None:
        return got
    count = plan.m // 2
    h0, h1 = heads if heads is not None else (0, plan.shape[0])
    order = layers if layers is not None else tuple(range(count))
    position = np.full(count, -1, dtype=np.int64)
    position[list(order)] = np.arange(len(order))

    def pick(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        part, head = np.divmod(rows.astype(np.int64), plan.shape[0])
        at = position[part // 2]
        keep = (at >= 0) & (head >= h0) & (head < h1)
        return keep, ((2 * at + part % 2) * (h1 - h0) + head - h0)[keep].astype(np.uint64)

    keep, rows = pick(full.rows)
    ckeep, crows = pick(full.copy_rows)
    got = _Jobs(full.src[keep], full.scale[keep], rows, full.copy_src[ckeep], crows, full.end)
    if len(cache) < 64:  # a worker asks for one selection; bounded whatever callers do
        cache[key] = got
    return got


def _checked_jobs(payloads: Sequence[np.ndarray], plan: "PayloadPlan", tokens: int, layers: tuple[int, ...] | None,
                  heads: tuple[int, int] | None) -> _Jobs:
    """:func:`_selected`'s jobs for ``layers`` and ``heads``, once the selection and the payloads are checked
    against the plan (every address a native call reads then lies inside its payload).

    Raises:
        ValueError: the selection is not layers and heads of the plan, or the payloads are not of its layout.
    """
    heads_all, bs, _ = plan.shape
    n = len(payloads)
    nbytes = payloads[0].shape[0]
    if layers is not None and (len(set(layers)) != len(layers) or any(not 0 <= i < plan.m // 2 for i in layers)
                               or not layers):
        raise ValueError(f"layers {list(layers)} are not distinct layers of the payload's {plan.m // 2}")
    if heads is not None and not 0 <= heads[0] < heads[1] <= heads_all:
        raise ValueError(f"heads {heads} are not a range of the payload's {heads_all}")
    jobs = _selected(plan, layers, None if heads == (0, heads_all) else heads)
    if (tokens < 1 or tokens > n * bs or jobs.end > nbytes
            or any(a.dtype != np.uint8 or a.shape != (nbytes,) or not a.flags.c_contiguous for a in payloads)):
        raise ValueError(f"payloads do not match the plan: {n} payloads of {nbytes} bytes for {tokens} tokens")
    return jobs


def gather_payloads(payloads: Sequence[np.ndarray], plan: "PayloadPlan", tokens: int, dtype: torch.dtype, *,
                    layers: Sequence[int] | None = None, heads: tuple[int, int] | None = None) -> torch.Tensor | None:
    """Every K/V part of consecutive snapshot payloads, as ``[parts, heads, tokens, dim]`` in ``dtype``.

    ``payloads`` are whole payloads (``uint8`` arrays of the plan's layout, e.g. the
    mappings themselves) of consecutive blocks; part ``2 * l + 0`` is K of layer ``l``,
    ``2 * l + 1`` its V. Native calls read every head of every part of every block where
    it lies and write it where it goes: the FP8 layers through their tables, the layers
    stored unquantised copied, when they are stored in ``dtype`` (otherwise their parts are
    left unwritten, for the caller to convert). Returns ``None`` without the native module,
    for output dtypes other than 2 or 4 bytes, or when there is nothing to do natively.

    ``layers`` (distinct layer indices) and ``heads`` (``(start, stop)``) select a share: the
    result is then ``[2 * len(layers), stop - start, tokens, dim]``, K and V of each selected
    layer in the order given, and only the selected heads' bytes are read (a pipeline stage
    reads its layers, a tensor-parallel rank its heads).

    Raises:
        ValueError: the payloads are not of the plan's layout, ``tokens`` is out of range, or
            the selection is not layers and heads of the plan.
    """
    esize = dtype.itemsize
    copies = plan.plain_dtype == dtype
    if _native is None or esize not in NP_SAME_SIZE or not payloads or (plan.fp8 is None and not copies):
        return None
    heads_all, bs, dim = plan.shape
    n = len(payloads)
    sel = tuple(int(i) for i in layers) if layers is not None else None
    jobs = _checked_jobs(payloads, plan, tokens, sel, heads)
    parts = 2 * len(sel) if sel is not None else plan.m
    out = memory.empty((parts, heads[1] - heads[0] if heads is not None else heads_all, tokens, dim), dtype)
    base = np.fromiter((_address(a) for a in payloads), dtype=np.uint64, count=n)
    if len(jobs.src) and dtype in _TABLES_IN_C:
        # each head's table is made in C from its scale, with the reference rounding
        _native.gather_blocks(base, jobs.src, jobs.scale, jobs.rows, _FP8_NP, out.data_ptr(), tokens, bs, dim,
                              esize)
    elif len(jobs.src):  # fp16 out: the tables from torch, then the job-list gather
        at = (jobs.scale[:, None] + np.arange(4, dtype=np.uint64)).reshape(-1)
        raw = np.stack([a[at] for a in payloads])  # [n, jobs * 4] bytes: each job's fp32 scale
        lut = tables(torch.from_numpy(raw.view(np.float32)), dtype).view(bits_dtype(dtype))
        first = np.arange(n, dtype=np.uint64)[:, None] * np.uint64(bs * dim * esize)
        dst = np.uint64(out.data_ptr()) + jobs.rows * np.uint64(tokens * dim * esize) + first
        rows = np.minimum(bs, tokens - np.arange(n) * bs).clip(0).astype(np.uint64)[:, None] * np.uint64(dim)
        _native.gather((base[:, None] + jobs.src).reshape(-1), dst.reshape(-1),
                       np.broadcast_to(rows, dst.shape).copy().reshape(-1), lut.numpy().reshape(-1), esize)
    if copies and len(jobs.copy_src):
        _native.copy_blocks(base, jobs.copy_src, jobs.copy_rows, out.data_ptr(), tokens, bs, dim, esize)
    return out


def gather_payloads_vec(payloads: Sequence[np.ndarray], plan: "PayloadPlan", tokens: int,
                        caches: Sequence[torch.Tensor], block_ids: Sequence[int], *, engine_block: int, skip: int = 0,
                        layers: Sequence[int] | None = None, heads: tuple[int, int] | None = None) -> bool:
    """:func:`gather_payloads` in bf16 written straight into vLLM's CPU cache blocks (``cpu_vec``), with
    no ``[parts, heads, tokens, dim]`` tensor between: token ``skip + i`` of every selected layer's K and V
    goes into engine block ``block_ids[i // engine_block]`` of ``caches[position of its layer]``, K transposed
    (``[dim, engine_block]`` per block and head) and V as is. The bits are :func:`gather_payloads`'s followed
    by :func:`store.engines.vllm.paging.write_layer`'s.

    Each cache is one layer's, ``num_blocks`` blocks of ``heads`` (the selection's) x 2 x
    ``engine_block * dim`` bf16 elements, contiguous on the CPU. Returns ``False``, writing nothing,
    where this does not apply: no native module, caches of another dtype, device or layout, or
    layers stored unquantised in a dtype other than bf16 (the caller dequantises, then writes). Layers
    stored in bf16 (kept layers, or a bf16 store) are copied the same way.

    Raises:
        ValueError: the payloads are not of the plan's layout, or the tokens from ``skip`` are not
            ``len(block_ids)`` whole engine blocks, or a block id is outside the caches.
    """
    if _native is None or not hasattr(_native, "gather_vec") or not payloads:
        return False
    if plan.plain_dtype not in (None, torch.bfloat16):
        return False  # layers kept in another dtype: converted by the caller's path
    heads_all, bs, dim = plan.shape
    h0, h1 = heads if heads is not None else (0, heads_all)
    sel = tuple(int(i) for i in layers) if layers is not None else tuple(range(plan.m // 2))
    if len(caches) != len(sel) or any(c.dtype != torch.bfloat16 or c.device.type != "cpu" or not c.is_contiguous()
                                      for c in caches):
        return False
    per_block = (h1 - h0) * 2 * engine_block * dim
    num_blocks = caches[0].shape[0]
    if any(c.shape[0] != num_blocks or c.numel() != num_blocks * per_block for c in caches):
        return False
    jobs = _checked_jobs(payloads, plan, tokens, None if layers is None else sel, (h0, h1))
    n = len(payloads)
    if (tokens - skip) != len(block_ids) * engine_block or skip < 0:
        raise ValueError(f"{tokens - skip} tokens from {skip} do not fill {len(block_ids)} engine blocks of "
                         f"{engine_block}")
    base = np.fromiter((_address(a) for a in payloads), dtype=np.uint64, count=n)
    dsts = np.fromiter((c.data_ptr() for c in caches), dtype=np.uint64, count=len(caches))
    _native.gather_vec(base, jobs.src, jobs.scale, jobs.rows, jobs.copy_src, jobs.copy_rows, _FP8_NP, dsts,
                       np.asarray(block_ids, dtype=np.int64), tokens, bs, dim, h1 - h0, engine_block, skip, num_blocks)
    return True
