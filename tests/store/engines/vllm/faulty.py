"""A kvwarm connector whose worker's reads fail at random, for the engine tests (runs inside vLLM).

Start vLLM with ``kv_connector="FaultyKvwarmConnector"``, ``kv_connector_module_path=
"tests.store.engines.vllm.faulty"``. Each load is the real one; then, with probability
``$KVWARM_FAULT_RATE`` (default 0.1), the read "fails" part-way: a random block of the load
and every block after it are filled with noise (what a torn or interrupted read leaves in
the engine's blocks) and reported failed, so that vLLM recomputes them. The choice is
seeded (``$KVWARM_FAULT_SEED``) and follows the order of loads, so a run is repeatable.
"""
from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import Any

import torch

from store.engines.vllm.connector import KvwarmConnector
from store.engines.vllm.metadata import LoadResult, LoadSpec
from store.engines.vllm.worker import WorkerRole

RATE_ENV, SEED_ENV = "KVWARM_FAULT_RATE", "KVWARM_FAULT_SEED"


class FaultyWorker(WorkerRole):
    """The worker role, with reads that fail part-way at random (counted ``load_failures:injected``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault_rate = float(os.environ.get(RATE_ENV, "0.1"))
        self._rng = random.Random(int(os.environ.get(SEED_ENV, "0")))

    def _load(self, spec: LoadSpec) -> LoadResult:
        result = super()._load(spec)
        blocks = result.loaded // self.engine_block
        if not blocks or self._rng.random() >= self.fault_rate:
            return result
        cut = self._rng.randrange(blocks)
        ids = list(spec.block_ids[cut:blocks])
        noise = torch.Generator().manual_seed(self._rng.randrange(1 << 30))
        for cache in self.caches:
            cache[ids] = torch.randn(cache[ids].shape, generator=noise).to(cache.dtype) * 4
        self.counters.add("injected_faults")
        return replace(result, loaded=cut * self.engine_block, reason="injected")


class FaultyKvwarmConnector(KvwarmConnector):
    """:class:`store.engines.vllm.KvwarmConnector` with :class:`FaultyWorker` as its worker role."""

    worker_class = FaultyWorker
