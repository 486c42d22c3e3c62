"""A loader's warm-up: the one-off costs of a process's first load, paid at start-up instead.

A freshly started serving process pays some costs on its first load only, on the request's critical path:

- the pool's first transactions on this thread's SQLite connection (its statements compiled, its pages read),
  and the tenant's namespace checked in the local tier;
- the first header of a geometry and precision parsed and checked
  (:func:`store.format.geometry.check_geometry` remembers the part lists it accepted), its payload layout
  interned, the layout's payload plan and the native gather's job table for this worker's share of it
  (:func:`store.format.runs.payload_plan`, ``store.kernels.table._jobs``: cached on the plan);
- the first output of a CPU gather: new memory, one page fault per page (or huge page)
  (:mod:`store.kernels.memory` keeps it for the next load of about its size, already faulted in). On the
  development VM this was most of it: 25-30 ms of a 2,048-token load at kvwarm-ref's shape.

:func:`warm_up` does each of these once, on a synthetic one-block snapshot of the model's geometry made
in memory: nothing is written to the store or the pool, no snapshot of the store is mapped, no pin or
admission is made, the engine's caches are not touched, and the loader's counters do not move. Whatever
fails is logged and the loader serves as it would have (its first load then pays what was not warmed).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import torch

from store.format.encode import StoredLayer, encode_snapshot, snapshot_bytes
from store.format.header import Layout
from store.format.precision import quantize
from store.format.runs import payload_plan
from store.format.snapshot import read_snapshot
from store.identity.keys import Block, block_chain

if TYPE_CHECKING:
    from store.format.payload import PayloadLayout
    from store.serving.loader import KVLoader

log = logging.getLogger("kvwarm.loader")
#: the token of the warm-up's block: the largest id a key accepts, in no tokenizer's vocabulary
NO_TOKEN = (1 << 32) - 1


def warm_up(loader: "KVLoader", geometry: Layout, dtype: torch.dtype, *, layers: Sequence[int] | None = None,
            heads: slice | None = None, device: str | torch.device = "cpu", tokens: int = 0) -> bool:
    """Pay ``loader``'s first-load costs now (see the module docstring); ``True`` when all of it ran.

    Args:
        loader: the loader an engine worker will load through.
        geometry: the model's whole geometry as stored (every layer and KV head; ``block_size`` is the
            store's block).
        dtype: the engine's KV dtype (what loads dequantise into).
        layers: the snapshot layers this worker loads, in its order (default: every layer).
        heads: the KV heads this worker loads, a range (default: every head).
        device: where the worker's caches live: the CPU gather (and its output memory) is warmed only on
            the CPU, the path a CPU worker's loads take.
        tokens: the output the CPU gather warms is this many tokens (rounded up to whole blocks; at least
            one block): a later load of about this size (:data:`store.kernels.memory.SLACK`) finds its
            memory ready. ``loader.warm_up_tokens`` in the config.

    Never raises: a failure is logged (the serving path never fails because of kvwarm) and ``False``
    returned.
    """
    t0 = time.perf_counter()
    try:
        _pool(loader)
        arrays, layout = _synthetic(loader, geometry)
        plan = payload_plan(layout)
        if torch.device(device).type == "cpu" and plan is not None:
            blocks = max(1, -(-tokens // geometry.block_size))
            chosen = tuple(range(geometry.num_layers)) if layers is None else tuple(int(i) for i in layers)
            share = (0, geometry.num_kv_heads) if heads is None else heads.indices(geometry.num_kv_heads)[:2]
            # the call a CPU worker's load makes (store.serving.hit.LoaderHit.dequantized), here on one
            # synthetic payload read ``blocks`` times: its plan's job table for this share is cached on
            # the plan, and its output memory goes back to the free list when ``kv`` goes
            kv = loader.dequantizer.payload_layers([(arrays, layout)] * blocks, blocks * geometry.block_size, dtype,
                                                   layers=chosen, heads=share)
            del kv
    except Exception as exc:  # noqa: BLE001 - a warm-up that fails only logs: loads work without it
        log.warning("kvwarm: the loader's warm-up failed; loads work without it (the first one pays the one-off "
                    "costs): %s", exc, exc_info=True)
        return False
    log.debug("kvwarm: loader warmed up in %.1f ms", (time.perf_counter() - t0) * 1e3)
    return True


def _pool(loader: "KVLoader") -> None:
    """The pool's first transactions on this thread, and the local tier's namespace check; changes nothing."""
    pool = loader.pool
    if pool.attached:  # not when refused at construction (max_shared_instances): the first lookup retries
        loader.mapper.reconcile()  # what every lookup asks first: the pool's eviction epoch
        pool.pin([])  # a write transaction (BEGIN IMMEDIATE) that pins, admits and evicts nothing
        pool.admissions(["kvwarm-warm-up"])  # a name no snapshot has: nothing is mapped
    # a chain no one stored (its tokens are in no vocabulary): the local tiers are asked, nothing else
    loader.store.probe(loader.tenant, [_block(loader)], loader.root, local_only=True)


def _synthetic(loader: "KVLoader", geometry: Layout) -> tuple[np.ndarray, "PayloadLayout"]:
    """A zero block of ``geometry`` in the loader's precision, encoded and read back as a served snapshot
    is (header parsed and checked, payload verified): its payload and its (interned) layout."""
    if geometry.block_size != loader.root.block_size:
        raise ValueError(f"the warm-up's geometry has {geometry.block_size}-token blocks; the store's are "
                         f"{loader.root.block_size}")
    zeros = torch.zeros((geometry.num_kv_heads, geometry.block_size, geometry.head_dim), dtype=torch.bfloat16)
    precision, by_dtype = loader.precision, {}
    for layer in range(geometry.num_layers):  # quantised once per storage dtype (seconds for an 8B model otherwise)
        if precision.layer_dtype(layer) not in by_dtype:
            by_dtype[precision.layer_dtype(layer)] = StoredLayer(*quantize(zeros, precision, layer) * 2)
    layers = [by_dtype[precision.layer_dtype(i)] for i in range(geometry.num_layers)]
    errors = {"k_rel_l2": [0.0] * len(layers), "v_rel_l2": [0.0] * len(layers)}
    snap = encode_snapshot(root=loader.root, block=_block(loader), tenant=loader.tenant.name, layers=layers,
                           errors=errors, precision=precision, created_at=loader.clock(), ttl_s=60.0)
    read = read_snapshot(pa.py_buffer(snapshot_bytes(snap)), location="warm-up", verify_payload=True)
    payload, layout = read.payload
    return payload, layout


def _block(loader: "KVLoader") -> Block:
    """The first block of a chain of :data:`NO_TOKEN` under the loader's key root (nothing stores it)."""
    return block_chain(loader.root, np.full(loader.root.block_size, NO_TOKEN, dtype=np.int64))[0]
