"""Dequantising stored KV into contiguous ``[kv_heads, tokens, head_dim]`` tensors.

Pure tensor code, no I/O. The stored dtype is dequantised straight into the
destination where possible:

- on the CPU, FP8 with per-head scales goes through a 256-entry table per head and a
  gather (:mod:`store.kernels.table`: the reference bits by construction; native with AVX-512 or AVX2
  when built, numpy otherwise), or (``compiled``) one ``torch.compile`` pass of the
  reference arithmetic. Unquantised parts (bf16 storage, layers that mixed precision
  keeps) are numpy copies of the stored bits (torch's copy starts an OpenMP team each time).
- whole snapshot payloads on the CPU (:meth:`Dequantizer.payload_layers`), mixed precision
  included: one operation per group (FP8 layers, kept layers) per snapshot, or one native
  gather for every FP8 part of a hit.
- to a GPU, FP8 runs with per-head scales are gathered into bounded, reused pinned host
  slots (:mod:`store.kernels.staging`), moved piece by piece (FP8 bytes, half of bf16's) and
  dequantised there by the reference arithmetic; anything else block by block through
  :func:`store.format.precision.dequantize`. (A vLLM worker's loads instead go chunk by chunk through the
  device's :class:`store.kernels.reservation.Reservation`: :mod:`store.kernels.chunks`.)

:mod:`store.engines.paged` writes the result into the caches engines use.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import warnings
from typing import TYPE_CHECKING, Callable, Literal, Sequence

import numpy as np
import torch

from store.format.precision import dequantize
from store.format.runs import NP_SAME_SIZE, PayloadPlan, payload_plan
from store.kernels import memory
from store.kernels.plain import copy_plain
from store.kernels.reservation import SCRATCH_BYTES, Reservation
from store.kernels.staging import STAGING_BYTES, Staging, stage_runs
from store.kernels.table import bits_dtype, gather_parts, gather_payloads, native_isa

if TYPE_CHECKING:
    from store.format.payload import PayloadLayout

log = logging.getLogger("kvwarm.dequant")


def dequantize_into(out: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor | None,
                    group_tokens: int = 0) -> None:
    """Write ``dequantize(stored, scale)`` into ``out`` (same shape ``[heads, tokens, dim]``, any strides).

    Bit-identical to :func:`store.format.precision.dequantize` followed by a copy into ``out``.
    """
    if out.shape != stored.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the stored part's {tuple(stored.shape)}")
    cpu = out.device.type == "cpu" and stored.device.type == "cpu"
    if cpu and scale is not None and gather_parts(out, stored, scale):
        return
    if cpu and scale is None and stored.dtype == out.dtype and out.element_size() in NP_SAME_SIZE:
        _copy_bits(out, stored)  # unquantised (kept layers, bf16 storage) into its own dtype
        return
    if cpu and scale is not None and scale.dim() == 1 and stored.dtype == torch.float8_e4m3fn \
            and out.element_size() in NP_SAME_SIZE:
        tmp = torch.empty(stored.shape, dtype=out.dtype)
        dequantize_into(tmp, stored, scale, group_tokens)
        out.copy_(tmp)
        return
    dev = out.device
    out.copy_(dequantize(stored.to(dev, non_blocking=True), None if scale is None else scale.to(dev), out.dtype,
                         group_tokens))


def _copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for CPU tensors of one 2- or 4-byte dtype, by numpy's copy of the bits
    (torch's copy starts an OpenMP team per call: ~50x slower per part on a busy 2-core host)."""
    idt = bits_dtype(dst.dtype)
    np.copyto(dst.view(idt).numpy(), src.view(idt).numpy())


def _fp8_layers(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Parts ``[m, n, heads, bs, dim]`` (FP8: m = K and V of every layer, n blocks) and scales
    ``[m, n, heads]`` to ``[m, heads, n*bs, dim]``.

    The reference arithmetic of :func:`store.format.precision.dequantize`, written for torch.compile
    (one fused pass that reads each byte once and writes the final layout).
    """
    m, n, heads, bs, dim = stored.shape
    y = (stored.to(torch.float32) * scale[:, :, :, None, None]).to(dtype)
    return y.permute(0, 2, 1, 3, 4).reshape(m, heads, n * bs, dim)


DequantMode = Literal["auto", "table", "compiled"]


def _is_share(plan: PayloadPlan, layers: Sequence[int] | None, heads: tuple[int, int] | None) -> bool:
    """Whether ``layers`` and ``heads`` ask for less than every layer and head, in stored order."""
    whole_layers = layers is None or tuple(layers) == tuple(range(plan.m // 2))
    return not (whole_layers and (heads is None or tuple(heads) == (0, plan.shape[0])))


class Dequantizer:
    """Dequantises runs of blocks (K and V of every layer) into ``[heads, tokens, dim]`` tensors.

    ``table`` (default): the per-head tables of :mod:`store.kernels.table` (no warm-up); with the
    native gather built, one call for every FP8 part of a hit (:meth:`payload_layers`),
    otherwise numpy, block by block. ``compiled``: CPU FP8 blocks with per-head scales go
    through one ``torch.compile`` of the reference arithmetic over every layer at once (one
    call per hit, the block count dynamic), built on first use of a geometry (seconds;
    inductor caches it on disk). ``auto``: the native table where it is built (faster than
    the compiled kernel: ``docs/benchmarks.md``), otherwise the numpy table until that kernel
    has been built in the background, so no request waits for a compiler (but the compile
    holds the GIL for seconds). All give the bits of :func:`store.format.precision.dequantize`; a
    kernel that fails to build leaves the table. Calling the object dequantises one block
    (always the table path).
    """

    def __init__(self, mode: DequantMode = "table", executor: cf.Executor | None = None, *,
                 staging_bytes: int = STAGING_BYTES, scratch_bytes: int = SCRATCH_BYTES) -> None:
        if mode not in ("auto", "table", "compiled"):
            raise ValueError(f"dequant mode {mode!r} is not allowed; choose auto, table or compiled")
        self.mode = mode
        self._executor = executor
        self._lock = threading.Lock()
        self._ready: set[tuple] = set()
        self._pending: set[tuple] = set()
        self._kernel: Callable[..., torch.Tensor] | None = None
        self._staging = Staging(staging_bytes)  # host buffers: hits bound for a GPU, whole payloads for the kernel
        self.scratch_bytes = int(scratch_bytes)
        self._reservations: dict[torch.device, Reservation] = {}

    def __call__(self, out: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor | None,
                 group_tokens: int = 0) -> None:
        dequantize_into(out, stored, scale, group_tokens)

    def _to_device(self, parts: Sequence[Sequence["BlockPart"]], dtype: torch.dtype,
                   dev: torch.device) -> torch.Tensor:
        """Uniform runs (FP8 with per-head scales, or unscaled) to ``[runs, heads, n*bs, dim]`` on ``dev``: the
        stored bytes sent through the staging (:func:`store.kernels.staging.stage_runs`), dequantised there."""
        staged = stage_runs(parts, dev, self._staging)
        assert staged is not None, "_to_device takes uniform runs"
        stored, scales = staged
        m, n, heads, bs, _ = stored.shape
        if scales is None:
            return stored.to(dtype).permute(0, 2, 1, 3, 4).reshape(m, heads, n * bs, -1)
        return _fp8_layers(stored, scales, dtype)

    @property
    def staging(self) -> Staging:
        """The pinned host slots every transfer to a device goes through (``loader.staging_bytes``)."""
        return self._staging

    def reservation(self, device: torch.device | str) -> Reservation:
        """The one :class:`store.kernels.reservation.Reservation` of ``device`` (``loader.device_scratch_bytes``,
        taken on first use) that the device kernels of this worker's loads and write-back share."""
        dev = torch.device(device)
        with self._lock:
            if dev not in self._reservations:
                self._reservations[dev] = Reservation(self.scratch_bytes, dev)
            return self._reservations[dev]

    def _compiled(self) -> Callable[..., torch.Tensor]:
        with self._lock:
            if self._kernel is None:
                self._kernel = torch.compile(_fp8_layers, dynamic=False)
            return self._kernel

    def _run(self, stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # The block count varies per hit: one graph for every count >= 2.
        torch._dynamo.mark_dynamic(stored, 1)
        torch._dynamo.mark_dynamic(scale, 1)
        return self._compiled()(stored, scale, dtype)

    def _build(self, key: tuple) -> None:
        try:
            if key[0] == "payload":  # whole payloads: see payload_layers
                _, nbytes, plan, dtype = key
                zeros = np.zeros(nbytes, dtype=np.uint8)
                self._payload_kernel([zeros, zeros], plan, dtype)
            else:
                (m, heads, bs, dim), dtype = key
                self._run(torch.zeros((m, 2, heads, bs, dim), dtype=torch.uint8).view(torch.float8_e4m3fn),
                          torch.ones((m, 2, heads)), dtype)
            with self._lock:
                self._ready.add(key)
        except Exception as exc:  # noqa: BLE001 - no compiler here: the table path stays
            log.warning("compiled dequantisation unavailable for %s (%s); using the table path", key, exc)
        finally:
            with self._lock:
                self._pending.discard(key)

    def _native(self) -> bool:
        """Whether FP8 payloads go through the native table gather (not in ``compiled`` mode)."""
        return self.mode != "compiled" and native_isa() is not None

    def _kernel_ready(self, key: tuple) -> bool:
        with self._lock:
            ready = key in self._ready
            start = not ready and key not in self._pending
            if start:
                self._pending.add(key)
        if start and (self.mode == "compiled" or self._executor is None):
            self._build(key)
            with self._lock:
                return key in self._ready
        if start and self._executor is not None:
            self._executor.submit(self._build, key)
        return ready

    def payload_layers(self, payloads: Sequence[tuple[np.ndarray, "PayloadLayout"]], tokens: int,
                       dtype: torch.dtype, *, layers: Sequence[int] | None = None,
                       heads: tuple[int, int] | None = None) -> list[torch.Tensor] | None:
        """On the CPU, K and V of every layer from whole snapshot payloads, one operation per group per snapshot.

        ``payloads`` are :attr:`store.format.snapshot.Snapshot.payload` of consecutive blocks.
        Returns, as :meth:`layers` does, one ``[heads, tokens, dim]`` tensor per K/V of each
        layer (K.0, V.0, K.1, ...), or ``None`` where this path does not apply and the
        caller must use :meth:`layers`: payloads of different layouts, per-group scales,
        parts that no strided view covers, FP8 layers in the ``table`` mode or with fewer
        than 2 blocks, or, for storage without FP8 layers, an output dtype other than the
        stored one. In ``auto`` mode before the kernel is built (or when it cannot be
        built) the table runs here, from the same views, so that :meth:`layers` does not
        start building another kernel.

        With the native module (modes ``table`` and ``auto``), :func:`store.kernels.table.gather_payloads`
        writes every part into one new ``[parts, heads, tokens, dim]`` tensor: FP8 layers
        through their tables, unquantised layers stored in ``dtype`` copied. Otherwise:

        - unquantised layers (all of them, or those that mixed precision keeps): one
          strided copy per snapshot (per run of layers at regular steps: one for
          ``keep_layers`` ``[0]``, ``[0, last]`` or consecutive layers), from the mapping
          straight into the final layout, converted to ``dtype`` as
          :func:`store.format.precision.dequantize` does where it differs;
        - FP8 layers with per-head scales: each payload's FP8 region is copied (one copy
          per snapshot, one per segment where kept layers sit between FP8 ones) into a
          reused staging buffer laid out so that every FP8 part and its scales are at
          regular steps, and one compiled pass of the reference arithmetic reads them
          there as strided views and writes the final layout.

        ``layers`` (distinct indices) and ``heads`` (``(start, stop)``) ask for a share: K and V
        of those layers, in that order, each ``[stop - start, tokens, dim]``. Only the native
        gather reads a share without reading the rest (:func:`store.kernels.table.gather_payloads`);
        where it does not apply to the whole share this returns ``None``, and :meth:`layers` reads
        the share's parts as views.
        """
        if not payloads or tokens < 1:
            return None
        layout = payloads[0][1]
        if any(lay is not layout for _, lay in payloads):
            return None
        plan = payload_plan(layout)
        if plan is None:
            return None
        n = len(payloads)
        _, bs, _ = plan.shape
        if tokens > n * bs or any(a.shape != (layout.nbytes,) for a, _ in payloads):
            return None
        group = plan.fp8
        if group is None and plan.plain_dtype != dtype:
            return None
        arrays = [a for a, _ in payloads]
        if _is_share(plan, layers, heads):
            return self._share(arrays, plan, tokens, dtype, layers, heads)
        out: list[torch.Tensor] = [None] * plan.m  # type: ignore[list-item]
        y = gather_payloads(arrays, plan, tokens, dtype) if self._native() else None
        if y is not None:
            out = list(y)
        elif group is not None and (self.mode == "table" or n < 2):
            return None
        if plan.plain and (y is None or plan.plain_dtype != dtype):  # not copied natively: converted here
            kept = copy_plain(arrays, plan, tokens, dtype)
            for p, layer in enumerate(plan.plain_layers):
                out[2 * layer], out[2 * layer + 1] = kept[p, 0], kept[p, 1]
        if group is not None and y is None:
            if self._kernel_ready(("payload", layout.nbytes, plan, dtype)):
                y = self._payload_kernel(arrays, plan, dtype)
                fp8 = [y[j] if y.shape[2] == tokens else y[j][:, :tokens] for j in range(len(group.data))]
            else:
                # auto before the kernel is built (or a kernel that failed to build): the table,
                # part by part, rather than starting the build of another kernel in layers()
                fp8 = self._table_from_payloads(arrays, plan, tokens, dtype)
            for j, layer in enumerate(group.layers):
                out[2 * layer], out[2 * layer + 1] = fp8[2 * j], fp8[2 * j + 1]
        return out

    def _share(self, arrays: Sequence[np.ndarray], plan: PayloadPlan, tokens: int, dtype: torch.dtype,
               layers: Sequence[int] | None, heads: tuple[int, int] | None) -> list[torch.Tensor] | None:
        """:meth:`payload_layers` of a share: the native gather of its jobs, and its unquantised layers
        converted here where they are stored in another dtype (``None`` without the native gather)."""
        if not self._native():
            return None  # the caller reads the share's parts (views of its heads)
        y = gather_payloads(arrays, plan, tokens, dtype, layers=layers, heads=heads)
        if y is None:
            return None
        out = list(y)
        order = tuple(range(plan.m // 2)) if layers is None else tuple(int(i) for i in layers)
        convert = {i for i in order if i in plan.plain_layers} if plan.plain_dtype != dtype else set()
        if convert:  # left unwritten by the gather: converted here, the share's heads only
            kept = copy_plain(arrays, plan, tokens, dtype, heads=heads, wanted=convert)
            for at, layer in enumerate(order):
                if layer in convert:
                    p = plan.plain_layers.index(layer)
                    out[2 * at], out[2 * at + 1] = kept[p, 0], kept[p, 1]
        return out

    def _table_from_payloads(self, payloads: Sequence[np.ndarray], plan: PayloadPlan, tokens: int,
                             dtype: torch.dtype) -> list[torch.Tensor]:
        """The FP8 parts (K and V of each FP8 layer), each through the per-head table."""
        group = plan.fp8
        assert group is not None
        heads, bs, dim = plan.shape
        size = heads * bs * dim
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mappings: torch cannot write to them
            flat = [torch.from_numpy(a) for a in payloads]
        out = []
        for d, s in zip(group.data, group.scales):
            run = [(f[d : d + size].view(torch.float8_e4m3fn).view(heads, bs, dim),
                    f[s : s + 4 * heads].view(torch.float32)) for f in flat]
            t = torch.empty((heads, tokens, dim), dtype=dtype)
            fill_contiguous(t, run, 0, self)
            out.append(t)
        return out

    def _payload_kernel(self, payloads: Sequence[np.ndarray], plan: PayloadPlan, dtype: torch.dtype) -> torch.Tensor:
        """FP8 parts of payloads -> ``[parts, heads, n*bs, dim]`` through the staging buffer and the compiled kernel."""
        group = plan.fp8
        assert group is not None
        n, m = len(payloads), len(group.data)
        heads, bs, dim = plan.shape
        row = group.row
        with self._staging.lock:  # held until the kernel has read the staging buffer
            host = self._staging.buffer(n * row).view(n, row)
            hnp = host.numpy()
            for i, arr in enumerate(payloads):
                for lo, hi, at in group.segments:
                    np.copyto(hnp[i, at : at + hi - lo], arr[lo:hi])
            stored = host.as_strided((m, n, heads, bs, dim), (group.step, row, bs * dim, dim, 1), group.base)
            scales = host.view(torch.float32).as_strided((m, n, heads), (group.scale_step // 4, row // 4, 1),
                                                         group.scale_base // 4)
            return self._run(stored.view(torch.float8_e4m3fn), scales, dtype)

    def layers(self, parts: Sequence[Sequence["BlockPart"]], tokens: int, dtype: torch.dtype,
               device: str | torch.device = "cpu", group_tokens: int = 0) -> list[torch.Tensor]:
        """Dequantise several runs of blocks (K and V of every layer) at once.

        ``parts[j]`` is one run of consecutive blocks; returns one ``[heads, tokens, dim]``
        tensor per run (the first ``tokens`` tokens of the run).
        """
        stored0, scale0 = parts[0][0]
        dev = torch.device(device)
        n = len(parts[0])
        fp8 = stored0.dtype == torch.float8_e4m3fn and scale0 is not None and scale0.dim() == 1
        uniform = (stored0.device.type == "cpu" and (fp8 or scale0 is None)
                   and all(len(run) == n and all(p.shape == stored0.shape and p.dtype == stored0.dtype
                                                 and (s is None) == (scale0 is None)
                                                 and (s is None or s.shape == scale0.shape) for p, s in run)
                           for run in parts))
        if uniform and dev.type != "cpu":
            y = self._to_device(parts, dtype, dev)
            return [y[j] if y.shape[2] == tokens else y[j][:, :tokens] for j in range(len(parts))]
        if (self.mode != "table" and not self._native() and n >= 2 and dev.type == "cpu" and uniform and fp8
                and self._kernel_ready(((len(parts), *stored0.shape), dtype))):
            stacked = torch.stack([p.view(torch.uint8) for run in parts for p, _ in run])
            stacked = stacked.view(torch.float8_e4m3fn).view(len(parts), n, *stored0.shape)
            scales = torch.stack([s for run in parts for _, s in run]).view(len(parts), n, -1)  # type: ignore[misc]
            y = self._run(stacked, scales, dtype)
            return [y[j] if y.shape[2] == tokens else y[j][:, :tokens] for j in range(len(parts))]
        out = []
        for run in parts:
            first = run[0][0]
            shape = (first.shape[0], tokens, first.shape[2])
            t = memory.empty(shape, dtype) if dev.type == "cpu" else torch.empty(shape, dtype=dtype, device=dev)
            fill_contiguous(t, run, group_tokens, self)
            out.append(t)
        return out


BlockPart = tuple[torch.Tensor, "torch.Tensor | None"]
"""One block's stored K (or V) of one layer, ``[heads, block_tokens, dim]``, and its scales."""


def fill_contiguous(out: torch.Tensor, parts: Sequence[BlockPart], group_tokens: int = 0,
                    dequant: Callable[..., None] = dequantize_into) -> None:
    """Dequantise consecutive blocks into ``out`` ``[heads, tokens, dim]`` (``tokens`` may end mid-block)."""
    t = 0
    total = out.shape[1]
    for stored, scale in parts:
        if t >= total:
            break
        n = min(stored.shape[1], total - t)
        if n == stored.shape[1]:
            dequant(out[:, t : t + n], stored, scale, group_tokens)
        else:  # the trimmed last block: dequantise whole (scales may be per group), keep the head
            tmp = torch.empty(stored.shape, dtype=out.dtype, device=out.device)
            dequant(tmp, stored, scale, group_tokens)
            if out.device.type == "cpu" and out.element_size() in NP_SAME_SIZE:
                _copy_bits(out[:, t : t + n], tmp[:, :n])
            else:
                out[:, t : t + n].copy_(tmp[:, :n])
        t += n
