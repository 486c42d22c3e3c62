"""A kvwarm connector whose worker's reads fail at random, for the engine tests (runs inside vLLM).

Start vLLM with ``kv_connector="FaultyKvwarmConnector"``, ``kv_connector_module_path=
"tests.store.engines.vllm.faulty"``. Each load is the real one, except that with probability
``$KVWARM_FAULT_RATE`` (default 0.1) the read "fails" part-way: a random block of the load
and every block after it are filled with noise in each layer before the forward reads it
(what a torn or interrupted read leaves in the engine's blocks) and reported failed, so that
vLLM recomputes them. The choice is seeded (``$KVWARM_FAULT_SEED``) and follows the order
of loads, so a run is repeatable.
"""
from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import Any

import torch

from store.engines.vllm.connector import KvwarmConnector
from store.engines.vllm.metadata import LoadResult, LoadSpec
from store.engines.vllm.transfer import OpenLoad
from store.engines.vllm.worker import WorkerRole

RATE_ENV, SEED_ENV = "KVWARM_FAULT_RATE", "KVWARM_FAULT_SEED"


class FaultyWorker(WorkerRole):
    """The worker role, with reads that fail part-way at random (counted ``load_failures:injected``).

    A load chosen to fail gets noise in its blocks from the cut on, in every layer, before the
    layer is marked ready for the forward (as a read that failed there would leave them).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault_rate = float(os.environ.get(RATE_ENV, "0.1"))
        self._rng = random.Random(int(os.environ.get(SEED_ENV, "0")))
        self._noise: dict[int, torch.Generator] = {}

    def _open(self, spec: LoadSpec) -> OpenLoad | LoadResult:
        op = super()._open(spec)
        if isinstance(op, OpenLoad) and op.ids and self._rng.random() < self.fault_rate:
            op.fail_from = self._rng.randrange(len(op.ids))
            self._noise[id(op)] = torch.Generator().manual_seed(self._rng.randrange(1 << 30))
            self.counters.add("injected_faults")
        return op

    def _write_layer(self, op: OpenLoad, index: int) -> None:
        super()._write_layer(op, index)
        noise = self._noise.get(id(op))
        if noise is not None and op.fail_from is not None:
            ids = list(op.ids[op.fail_from:])
            cache = self.caches[index]
            cache[ids] = (torch.randn(cache[ids].shape, generator=noise) * 4).to(cache.dtype)

    def _close(self, op: OpenLoad) -> LoadResult:
        injected = self._noise.pop(id(op), None) is not None
        result = super()._close(op)
        return replace(result, reason="injected") if injected else result


class FaultyKvwarmConnector(KvwarmConnector):
    """:class:`store.engines.vllm.KvwarmConnector` with :class:`FaultyWorker` as its worker role."""

    worker_class = FaultyWorker
