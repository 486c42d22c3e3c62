"""Where the K/V parts of a snapshot payload lie, as a plan for reading them in bulk.

:class:`store.format.payload.PayloadLayout` says where each part of a payload is; a
:class:`PayloadPlan` groups them for :meth:`store.kernels.dequant.Dequantizer.payload_layers`:
the FP8 layers (with per-head fp32 scales) as one strided view of a staging row, the
unquantised layers (bf16/fp16, e.g. the layers mixed precision keeps) as runs at regular
steps, so that a whole payload is read with one operation per group. Pure arithmetic on
offsets; cached on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from store.format.precision import STORAGE_DTYPES

if TYPE_CHECKING:
    from store.format.payload import PayloadLayout

#: element size -> the numpy integer type that copies such elements bit-exactly
NP_SAME_SIZE: dict[int, type] = {2: np.int16, 4: np.int32}


@dataclass(frozen=True)
class PlainRun:
    """Unquantised layers whose K and V parts lie at two regular steps in the payload, so that
    their bytes in one snapshot are one strided view ``[layers, 2, heads, block tokens, dim]``."""

    first: int  # position of the run's first layer among the unquantised layers
    count: int  # layers in the run
    base: int  # byte offset of the first layer's K
    layer_step: int  # bytes from one layer's K to the next's
    kv_step: int  # bytes from a layer's K to its V


@dataclass(frozen=True)
class Fp8Group:
    """The FP8 layers of a layout (per-head fp32 scales), and how to stage them for one kernel.

    ``data[j]`` and ``scales[j]`` are the payload byte offsets of FP8 part ``j`` (K and V of
    each FP8 layer in order) and of its scales. Staging copies the payload bytes
    ``[start, end)`` of each segment (FP8 layers with no unquantised layer between them) to
    ``at`` in a row of ``row`` bytes per snapshot, placed so that in the row part ``j`` lies at
    ``base + j * step`` and its scales at ``scale_base + j * scale_step``: one strided view for
    all of them, whatever unquantised layers sat between them in the payload.
    """

    layers: tuple[int, ...]
    data: tuple[int, ...]
    scales: tuple[int, ...]
    segments: tuple[tuple[int, int, int], ...]  # (start, end, at)
    row: int
    base: int
    step: int
    scale_base: int
    scale_step: int


@dataclass(frozen=True)
class PayloadPlan:
    """How every K/V part of a payload layout (in the order K.0, V.0, K.1, ...) is read with one
    operation per group per snapshot: the FP8 layers (one staging copy per segment, then one
    kernel or the table) and the unquantised layers (one strided copy per run)."""

    m: int  # parts: K and V of every layer
    shape: tuple[int, int, int]  # heads, block tokens, head dim (the same for every part)
    fp8: Fp8Group | None
    plain_layers: tuple[int, ...]  # the unquantised layers, in order
    plain_dtype: torch.dtype | None  # their stored dtype (one for all)
    plain: tuple[PlainRun, ...]


def _plain_runs(offsets: Sequence[tuple[int, int]], esize: int) -> tuple[PlainRun, ...] | None:
    """Group layers (their K and V byte offsets, in order) into runs at regular steps."""
    runs: list[PlainRun] = []
    for i, (k, v) in enumerate(offsets):
        if k % esize or v % esize or v <= k:
            return None
        last = runs[-1] if runs else None
        if last is not None and v - k == last.kv_step and k > last.base and (
                last.count == 1 or k == last.base + last.count * last.layer_step):
            runs[-1] = PlainRun(last.first, last.count + 1, last.base, k - last.base if last.count == 1
                                 else last.layer_step, last.kv_step)
        else:
            runs.append(PlainRun(i, 1, k, 0, v - k))
    return tuple(runs)


def _fp8_group(layout: "PayloadLayout", layers: Sequence[int], heads: int) -> Fp8Group | None:
    """Where the FP8 parts of ``layers`` and their scales lie, and a staging row in which both
    are at regular steps (``None`` where no such row exists)."""
    index = layout.index()
    names = [f"{kv}.{i}" for i in layers for kv in ("k", "v")]
    snames = [f"{kv}_scale.{i}" for i in layers for kv in ("k", "v")]
    if any(layout.parts[index[s]][1:3] != ("fp32", (heads,)) for s in snames):
        return None  # per-group scales, or not fp32
    data = [layout.offsets[index[n]] for n in names]
    scales = [layout.offsets[index[s]] for s in snames]
    step = data[1] - data[0]  # K to V; in the staging row, every later step equals it
    runs: list[list[int]] = []  # FP8 layers (positions in ``layers``) with no other layer between them
    for j, layer in enumerate(layers):
        if j and layer == layers[j - 1] + 1:
            runs[-1].append(j)
        else:
            runs.append([j])
    segments: list[tuple[int, int, int]] = []
    shift: list[int] = []  # per part: staging row offset - payload offset
    base = end = 0
    for run in runs:
        own = [index[f"{kv}{sfx}.{layers[j]}"] for j in run for kv in ("k", "v") for sfx in ("", "_scale")]
        lo = min(layout.offsets[i] for i in own)
        hi = max(layout.offsets[i] + layout.parts[i][3] for i in own)
        if not segments:
            base = data[0] - lo
        at = base + 2 * run[0] * step - (data[2 * run[0]] - lo)  # where the run's first K must land
        if at < end:
            return None
        segments.append((lo, hi, at))
        shift += [at - lo] * (2 * len(run))
        end = at + hi - lo
    vdata = [o + d for o, d in zip(data, shift)]
    vscales = [o + d for o, d in zip(scales, shift)]
    sstep = vscales[1] - vscales[0]
    regular = (all(o == base + j * step for j, o in enumerate(vdata))
               and all(o == vscales[0] + j * sstep for j, o in enumerate(vscales))
               and step >= layout.parts[index[names[0]]][3] and vscales[0] % 4 == 0 and sstep % 4 == 0
               and all(s % 4 == 0 for s in scales))  # fp32 views, in the payload and in the row
    if not regular:
        return None
    return Fp8Group(tuple(layers), tuple(data), tuple(scales), tuple(segments), -(-end // 64) * 64, base, step,
                     vscales[0], sstep)


def payload_plan(layout: "PayloadLayout") -> PayloadPlan | None:
    """The regular structure of ``layout`` (cached per layout), or ``None`` if it has none
    (per-group scales, parts of different shapes, unquantised layers of different dtypes,
    FP8 parts that no staging row puts at regular steps)."""
    if "_strided" in layout.__dict__:
        return layout.__dict__["_strided"]
    plan = None
    try:
        index = layout.index()
        layers = sum(1 for p in layout.parts if p[0].startswith("k.") and p[0][2:].isdigit())
        data = [layout.parts[index[f"{kv}.{i}"]] for i in range(layers) for kv in ("k", "v")]
        first = data[0]
        fp8 = [i for i in range(layers) if data[2 * i][1] == "fp8_e4m3"]
        plain = [i for i in range(layers) if i not in fp8]
        scaled = {i for i in range(layers) if f"k_scale.{i}" in index or f"v_scale.{i}" in index}
        ok = (len(first[2]) == 3 and all(d[2] == first[2] for d in data) and scaled == set(fp8)
              and all(data[2 * i + 1][1] == data[2 * i][1] for i in range(layers))
              and len({data[2 * i][1] for i in plain}) <= 1)
        group = _fp8_group(layout, fp8, first[2][0]) if ok and fp8 else None
        runs: tuple[PlainRun, ...] | None = ()
        plain_dtype = STORAGE_DTYPES[data[2 * plain[0]][1]] if ok and plain else None
        if ok and plain:
            esize = torch.empty((), dtype=plain_dtype).element_size()
            runs = _plain_runs([(layout.offsets[index[f"k.{i}"]], layout.offsets[index[f"v.{i}"]]) for i in plain],
                               esize) if esize in NP_SAME_SIZE else None
        if layers and ok and (group is not None or not fp8) and runs is not None:
            shape = (first[2][0], first[2][1], first[2][2])
            plan = PayloadPlan(2 * layers, shape, group, tuple(plain), plain_dtype, runs)
    except (KeyError, IndexError, ValueError):
        plan = None
    object.__setattr__(layout, "_strided", plan)  # a cache on the (frozen) layout
    return plan
