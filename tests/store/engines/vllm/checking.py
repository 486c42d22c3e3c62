"""A kvwarm connector whose worker checks, after each load, that every engine layer holds its own snapshot
layer (runs inside vLLM, for the pipeline-parallel engine test).

Start vLLM with ``kv_connector="CheckingKvwarmConnector"``, ``kv_connector_module_path=
"tests.store.engines.vllm.checking"``. Each load is the real one; then the worker reads back the
loaded blocks of every cache vLLM registered, by the name vLLM gave it, and compares them with
the stored snapshot layer whose number that name carries (read here from the name, apart from the
connector's own mapping), dequantised again, heads of this tensor-parallel rank only (vLLM's rank). It counts ``layers_checked`` and ``layers_wrong``
(the scheduler's ``stats()`` sums them over every worker). Greedy tokens alone cannot tell: on
the tiny model, a second stage loaded with snapshot layers 0-1 instead of 2-3 gave the same 16
tokens.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from store.engines.vllm.connector import KvwarmConnector
from store.engines.vllm.metadata import LoadResult
from store.engines.vllm.paging import read_layer
from store.engines.vllm.transfer import OpenLoad
from store.engines.vllm.worker import WorkerRole


class CheckingWorker(WorkerRole):
    """The worker role, checking after each load that each named cache holds its own layer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.named: dict[str, torch.Tensor] = {}  # vLLM's name -> cache (set by the connector)

    def _close(self, op: OpenLoad) -> LoadResult:
        # every layer of the load is written by now (the loader thread closes a load after its last layer)
        spec = op.spec
        loaded = (op.end if op.fail_from is None else spec.start + op.fail_from * self.engine_block) - spec.start
        if loaded > 0 and self.layout is not None:
            kv = op.hit.dequantized(self.layout.dtype, tokens=spec.start + loaded)  # every layer and head, again
            heads = slice(self.tp_rank * self.layout.num_kv_heads, (self.tp_rank + 1) * self.layout.num_kv_heads)
            ids = list(spec.block_ids[: loaded // self.engine_block])
            for name, cache in self.named.items():
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1))  # type: ignore[union-attr]
                k, v = read_layer(cache, self.layout, ids)
                ok = (torch.equal(k, kv[2 * layer][heads, spec.start:]) and
                      torch.equal(v, kv[2 * layer + 1][heads, spec.start:]))
                self.counters.add("layers_checked")
                if not ok:
                    self.counters.add("layers_wrong")
        return super()._close(op)


class CheckingKvwarmConnector(KvwarmConnector):
    """:class:`store.engines.vllm.KvwarmConnector` with :class:`CheckingWorker` as its worker role."""

    worker_class = CheckingWorker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert isinstance(self._worker, CheckingWorker)
        self._worker.named = dict(kv_caches)
