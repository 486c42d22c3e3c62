"""Writing a prefill batch's blocks: quantised where the KV is, encoded, stored through the store.

:class:`BlockWriter` is the second half of a batch of the prefill job
(:mod:`prefill.runner` computes the KV, this writes it): every full block of every
segment of the batch becomes one snapshot, written atomically through
:meth:`store.tiers.store.Store.put`, so nothing partial is ever visible. A block the
store already holds is not rewritten (counted as skipped).
"""
from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from prefill.schedule import Segment
from store.format.encode import StoredLayer, encode_snapshot
from store.format.header import PREFILL
from store.format.precision import Precision, dequantize, quantize, relative_errors
from store.identity.keys import Block
from store.identity.tenant import Tenant
from store.tiers.store import Store


@dataclass(frozen=True)
class Written:
    """What one batch's write did."""

    written: int
    skipped: int
    quant_error_max: float


@dataclass
class _Quantised:
    """One batch's stored blocks on the host: ``parts[layer][k|v] = (stored [blocks, ...], scales)``
    and ``errors[k|v][layer][block]``."""

    parts: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = field(default_factory=dict)
    errors: dict[str, list[list[float]]] = field(default_factory=dict)


class BlockWriter:
    """Writes the blocks a batch computed into one store, at one precision and block size.

    Args:
        threads: threads encoding and writing a batch's snapshots (checksums and file
            writes release the GIL; 1 writes them one by one).
    """

    def __init__(self, store: Store, precision: Precision, block_size: int, threads: int = 1) -> None:
        self.store = store
        self.precision = precision
        self.block_size = block_size
        self.threads = max(1, threads)

    def write(self, layers: Sequence, segments: Sequence[Segment], past_tokens: int, tenants: Mapping[str, Tenant],
              now: float) -> Written:
        """Store every block of ``segments`` from the batch's per-layer KV ``layers`` (row ``j`` is segment ``j``,
        its blocks starting after ``past_tokens``), created at ``now``.

        Raises the first write failure, after the other writes of the batch finished.
        """
        bs = self.block_size
        where = [(j, past_tokens + n * bs) for j, s in enumerate(segments) for n in range(len(s.blocks))]
        stored = self._quantise(layers, where)
        jobs = [(tenants[s.tenant], s, block) for s in segments for block in s.blocks]
        with cf.ThreadPoolExecutor(self.threads, thread_name_prefix="kvwarm-write") as ex:
            futures = [ex.submit(self._write, tenant, s, block, stored, b, now) for b, (tenant, s, block) in enumerate(jobs)]
            written = [f.result() for f in futures]  # the first failure is raised here, after the others finished
        errors = [e for errs in stored.errors.values() for per_layer in errs for e in per_layer]
        return Written(sum(written), len(written) - sum(written), max(errors, default=0.0))

    def _quantise(self, layers: Sequence, where: list[tuple[int, int]]) -> _Quantised:
        """Quantise every written block of the batch, layer by layer, where the KV is.

        On a GPU this is a handful of kernels per layer over all blocks at once and one
        copy of the stored bytes (not the bf16 KV) to the host, instead of a dozen small
        kernels and a synchronisation per block, layer and K/V. Each block is quantised
        exactly as :func:`store.format.snapshot.build_snapshot` would quantise it alone.
        """
        out = _Quantised()
        if not where:
            return out
        prec, bs = self.precision, self.block_size
        for i, layer in enumerate(layers):
            for name, t in (("k", layer.keys), ("v", layer.values)):
                x = torch.stack([t[j, :, lo: lo + bs] for j, lo in where])  # [blocks, heads, bs, dim]
                q, scale = quantize(x, prec, i)
                err = relative_errors(x, dequantize(q, scale, torch.float32, prec.group_tokens))
                out.parts.setdefault(i, {})[name] = (q.cpu(), None if scale is None else scale.cpu())
                out.errors.setdefault(name, []).append(err.cpu().tolist())
        return out

    def _write(self, tenant: Tenant, seg: Segment, block: Block, q: _Quantised, b: int, now: float) -> bool:
        """Encode and store block ``b`` of the batch; ``True`` if it was written (not already there)."""
        layers = [StoredLayer(p["k"][0][b], None if p["k"][1] is None else p["k"][1][b],
                              p["v"][0][b], None if p["v"][1] is None else p["v"][1][b])
                  for _, p in sorted(q.parts.items())]
        errors = {f"{name}_rel_l2": [per_layer[b] for per_layer in q.errors[name]] for name in ("k", "v")}
        snap = encode_snapshot(root=seg.root, block=block, tenant=tenant.name, layers=layers, errors=errors,
                               precision=self.precision, created_at=now, ttl_s=seg.ttl_s, source=PREFILL)
        return self.store.put(tenant, snap)
