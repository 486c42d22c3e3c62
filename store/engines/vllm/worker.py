"""The connector's worker role: load planned snapshots into the engine's blocks, copy blocks out for write-back.

It runs in vLLM's worker, beside the model, and only moves bytes the scheduler planned:

- :meth:`WorkerRole.start_load`: for each :class:`store.engines.vllm.metadata.LoadSpec`, the tenant's
  :class:`store.serving.loader.KVLoader` maps the chain's snapshots from the node's shared pool
  (verified on first entry into the pool, pinned while used), :meth:`store.serving.hit.LoaderHit.dequantized`
  dequantises the needed blocks of this worker's share into the engine's KV dtype (its layers, by their
  global numbers, under pipeline parallel; its KV heads under tensor parallel; the native FP8 table
  gather where built), and :func:`store.engines.vllm.paging.write_layer` writes each layer into the
  engine blocks vLLM assigned; on a device, each layer's stored bytes go there as they are and
  :meth:`store.serving.hit.LoaderHit.scatter` writes them into the blocks (one dequantise and scatter per
  chunk, in the device's one reservation).
  Synchronous: vLLM runs the forward after it (docs/guides/engines.md says why). Whatever was not loaded
  (a snapshot gone, corrupt, expired) is reported by engine block id, and vLLM recomputes it.
- :meth:`WorkerRole.after_forward`: stores the blocks of the step's saves out of the cache (one gather and
  FP8 quantise per layer, where the cache lives) for :class:`store.engines.vllm.writeback.WriteBack`, only
  as far as they hold valid KV
  (:class:`store.engines.vllm.validity.BlockLedger`: a failed load poisons every block computed
  over it, in any request); times the step for the scheduler's prefill estimate.
- :meth:`WorkerRole.prefetch`: at start-up, the plan's prefixes into the node's pool (``KVLoader.prefetch``,
  whose retention follows the plan's scores).

No vLLM import: the connector passes the tensors and the layout in.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from store.engines.vllm.fences import Fences
from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import LoadResult, LoadSpec, SaveSpec, StepPlan, WorkerReport
from store.engines.vllm.nodes import node_client
from store.engines.vllm.paging import write_layer
from store.engines.vllm.parallel import head_range
from store.engines.vllm.ring_saves import ring_saves
from store.engines.vllm.settings import ConnectorSettings, check_block_sizes
from store.engines.vllm.stats import Counters
from store.engines.vllm.tenancy import TenantBook
from store.engines.vllm.transfer import OpenLoad, StepLoad, run_loads
from store.engines.vllm.validity import BlockLedger
from store.engines.vllm.writeback import WriteBack
from store.format.header import Layout
from store.identity.fingerprint import ModelIdentity
from store.kernels.dequant import Dequantizer
from store.kernels.gather import block_ids
from store.serving.loader import KVLoader
from store.serving.warmup import warm_up
from store.tiers.registry import tiers_from_url
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")
#: Writes one layer's K and V (``[kv_heads, n * block, head_dim]``) into engine blocks: ``(cache, block_ids, k, v)``.
BlockWriter = Callable[[torch.Tensor, Sequence[int], torch.Tensor, torch.Tensor], None]
#: A step counts towards the prefill rate when at least this share of its tokens are prompt tokens ...
PREFILL_SHARE = 0.9
#: ... and at least this many.
PREFILL_MIN_TOKENS = 64


@dataclass
class _Pending:
    """A step's loads in flight on the loader thread."""

    specs: tuple[LoadSpec, ...]
    job: StepLoad
    results: list[LoadResult] | None = None


class WorkerRole:
    """Everything the worker side of :class:`store.engines.vllm.KvwarmConnector` does.

    Args:
        settings: the checked extra config.
        identities: the model's plain and chat-keyed identities.
        engine_block: vLLM's block size.
        tp_rank, tp_size: this worker's tensor-parallel rank (it holds a slice of the KV heads).
        clock: seconds for timings.
    """

    def __init__(self, settings: ConnectorSettings, *, identities: tuple[ModelIdentity, ModelIdentity | None],
                 engine_block: int, tp_rank: int = 0, tp_size: int = 1,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        cfg = settings.config
        self.settings = settings
        self.identities = identities
        self.kv_block = cfg.kv_cache.block_size
        self.engine_block = engine_block
        check_block_sizes(self.kv_block, engine_block)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.tenants = TenantBook(cfg, settings.tenant)
        self.dequantizer = Dequantizer(cfg.loader.dequant, staging_bytes=int(cfg.loader.staging_bytes),
                                       scratch_bytes=int(cfg.loader.device_scratch_bytes))
        self.counters = Counters()
        self.clock = clock
        self.layout: EngineLayout | None = None
        self.caches: list[torch.Tensor] = []
        self.writer: WriteBack | None = None
        self._lock = threading.Lock()
        self._loaders: dict[tuple[str, bool], KVLoader] = {}
        self._failed: set[int] = set()
        self._finished_loads: set[str] = set()
        self.ledger = BlockLedger(engine_block)
        self.fences = Fences("cpu")  # the caches' device's, once registered
        self._pending: _Pending | None = None
        self._report = WorkerReport()
        self._step_start = 0.0
        self._load_seconds = 0.0

    # -- setup ---------------------------------------------------------------
    def register(self, caches: Sequence[torch.Tensor], layout: EngineLayout, *, total_kv_heads: int,
                 writer: BlockWriter | None = None, layers: Sequence[int] | None = None,
                 total_layers: int | None = None) -> None:
        """The engine's per-layer KV tensors (in layer order) and their layout.

        ``layers[i]`` is the model's (global) layer number of ``caches[i]``: the snapshot layer it
        loads (a pipeline stage holds some of the model's ``total_layers``; by default
        ``0..len(caches)-1``, every layer). Write-back runs only where this worker holds every layer
        and head. ``writer(cache, block_ids, k, v)`` writes a load into one layer's blocks (the
        engine's own cache kernel, where the connector has one); by default
        :func:`store.engines.vllm.paging.write_layer`.

        Raises:
            ValueError: this worker's heads are not an equal share of the model's, or ``layers`` are
                not one distinct layer per cache.
            ConfigError: ``kv_cache.keep_layers`` names a layer the model does not have.
        """
        self.settings.config.kv_cache.precision().check_layers(
            len(caches) if total_layers is None else total_layers, model="the engine's model")
        if layout.num_kv_heads * self.tp_size != total_kv_heads:
            raise ValueError(f"kvwarm connector: the engine holds {layout.num_kv_heads} KV heads per worker over "
                             f"{self.tp_size} workers (--tensor-parallel-size); the model has {total_kv_heads} "
                             "(replicated heads are not supported)")
        held = tuple(range(len(caches))) if layers is None else tuple(int(i) for i in layers)
        if len(held) != len(caches) or len(set(held)) != len(held):
            raise ValueError(f"kvwarm connector: layers {list(held)} are not one distinct layer for each of the "
                             f"{len(caches)} KV caches")
        self.caches = list(caches)
        self.layout = layout
        self._layers = held
        self._write: BlockWriter = writer or (lambda cache, ids, k, v: write_layer(cache, layout, ids, k, v))
        self._scatter = writer is None  # a device load may then dequantise straight into the blocks
        if self.caches:  # a GPU worker loads beside the forward; a CPU worker in start_load_kv (beside, both were slower)
            self.fences.close()
            self.fences = Fences(self.caches[0].device, timeout_s=self.fences.timeout_s)
        self._heads = head_range(self.tp_rank, layout.num_kv_heads)
        cfg = self.settings.config
        every_layer = held == tuple(range(n_layers := len(caches) if total_layers is None else total_layers))
        geometry = Layout(n_layers, total_kv_heads, layout.head_dim, self.kv_block)
        for chat in (False, True) if self.identities[1] is not None else (False,):  # made and warmed now, not in a load
            warm_up(self.loader(self.tenants.default, chat), geometry, layout.dtype, layers=held, heads=self._heads,
                    device=caches[0].device if caches else "cpu", tokens=cfg.loader.warm_up_tokens)
        if self.settings.write_back and self.tp_size == 1 and every_layer:
            lc, precision, ttl_s = cfg.loader, cfg.kv_cache.precision(), cfg.kv_cache.ttl_seconds()
            handoff = None if lc.write_back_via != "node" else ring_saves(  # the node writes, through a ring
                node_client(self.settings, autostart=False), tenants=self.tenants, identities=self.identities,
                precision=precision, kv_block=self.kv_block, ttl_s=ttl_s, layout=layout, layers=len(caches),
                counters=self.counters, ring_bytes=int(lc.write_back_ring_bytes))
            self.writer = WriteBack(Store(tiers_from_url(self.settings.store_url, cfg.store)), self.tenants,
                                    self.identities, precision, kv_block=self.kv_block, ttl_s=ttl_s, layout=layout,
                                    counters=self.counters, max_bytes=int(lc.write_back_queue_bytes),
                                    streams=lc.write_back_streams, s3_backoff_s=lc.s3_backoff_s,
                                    upload=lc.write_back_via != "node", handoff=handoff,
                                    device_streams=self.fences.streams, reservation=None if self.caches[0].device.type
                                    == "cpu" else self.dequantizer.reservation(self.caches[0].device))

    def loader(self, tenant: str, chat: bool) -> KVLoader:
        """The loader of ``tenant``'s chains, plain or chat-keyed (one per pair, made on first use)."""
        key = (tenant, chat)
        with self._lock:
            got = self._loaders.get(key)
        if got is None:
            identity = self.identities[1] if chat else self.identities[0]
            if identity is None:
                raise ValueError("this model has no chat template: there is no chat-keyed chain")
            # every tier, but a lookup never waits on S3: the scheduler planned only what NVMe holds; the
            # machine's node makes the copies S3 -> NVMe (a miss's, the agent's prefetches) while it answers
            got = KVLoader(self.settings.store_url, tenant=self.tenants.credentials(tenant), model=identity,
                           config=self.settings.config, dequant=self.dequantizer, fetch_mode="background",
                           node=node_client(self.settings, autostart=False))
            with self._lock:
                got = self._loaders.setdefault(key, got)
        return got

    # -- a step --------------------------------------------------------------
    def begin_step(self, plan: StepPlan) -> None:
        """The step's metadata arrived (vLLM binds it just before the forward): its tables go to the ledger."""
        self._step_start = self.clock()
        self._load_seconds = 0.0
        try:
            blind = self.ledger.blind
            self.ledger.begin(plan.computes, decodes=plan.decodes, copies=plan.copies, ended=plan.ended)
        except Exception:  # noqa: BLE001 - the ledger cannot follow this step: nothing more is stored
            log.exception("kvwarm: could not follow this step's blocks")
            self.ledger.blind = True
        if self.ledger.blind and not blind and self.writer is not None:
            log.error("kvwarm write-back stops: the connector lost track of which engine blocks hold valid KV "
                      "(a scheduler-side failure, logged above); restart the engine to write back again")

    def start_load(self, plan: StepPlan) -> None:
        """Start this step's loads on the loader thread; the forward waits per layer (:meth:`wait_layer`).

        What fails is reported by block id once the loads are done (:meth:`take_failed`).
        """
        self._finish_loads()
        # the compute stream waits until the last write-back read the cache; the loads wait for that point
        job = self.fences.start(len(self.caches), self.writer, loads=bool(plan.loads))
        if job is None:
            return
        pending = _Pending(plan.loads, job)
        self._pending = pending

        # the lookups here, before the forward starts: they are Python (mapping, checks), and beside the
        # forward they would take the GIL from it; dequantising and writing release it, so they go beside it
        opened = [self._open(spec) for spec in plan.loads]

        def work() -> None:
            try:
                pending.results = run_loads(opened, job, write_layer=self._write_layer, close_load=self._close)
            finally:
                job.complete()

        self.fences.run(work)  # on the load stream: on the loader thread (a GPU), or here (the CPU)

    def wait_layer(self, index: int) -> None:
        """Before the forward's attention reads local layer ``index``: wait until this step's loads wrote it."""
        pending = self._pending
        if pending is not None:
            t0 = self.clock()
            pending.job.wait(index)
            self._load_seconds += self.clock() - t0

    def _finish_loads(self) -> None:
        """Wait for this step's loads, then account for them (failed blocks, the ledger, counters, report)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = self.clock()
        pending.job.wait_all()
        self._load_seconds += self.clock() - t0
        results = pending.results
        if results is None or pending.job.timed_out:  # a loader that did not finish: none of its writes is trusted
            results = [LoadResult(s.req_id, 0, s.end - s.start, reason="timeout") for s in pending.specs]
        for spec, result in zip(pending.specs, results):
            loaded_blocks = result.loaded // self.engine_block
            self.ledger.loaded(spec.block_ids, loaded_blocks)
            if spec.deferred:  # the request waits for it: it is finished, failed blocks and all
                self._finished_loads.add(spec.req_id)
            if result.loaded < result.planned:
                self._failed.update(spec.block_ids[loaded_blocks:])
                self.counters.add("load_failures", reason=result.reason or "error")
            if result.loaded:
                self.counters.add("loads")
                self.counters.add("tokens_loaded", result.loaded)
                self.counters.add("bytes_loaded", result.nbytes)
                self.counters.add("load_seconds", result.seconds)
                self.counters.sample(result.seconds)
            self._report.loads.append(result)

    def _open(self, spec: LoadSpec) -> OpenLoad | LoadResult:
        """Look the load's chain up (mapped, checked, pinned): what it can give, or why nothing."""
        planned = spec.end - spec.start
        hit = None
        try:
            if not spec.token_ids or self.layout is None:
                return LoadResult(spec.req_id, 0, planned, reason="error")
            t0 = self.clock()
            hit, reason = self.loader(spec.tenant, spec.chat).lookup_with_reason(spec.token_ids)
            if hit is None:
                return LoadResult(spec.req_id, 0, planned, reason=reason or "absent")
            end = min(spec.end, hit.tokens) // self.engine_block * self.engine_block
            if end <= spec.start:
                tier = hit.tier
                hit.release()
                return LoadResult(spec.req_id, 0, planned, reason=reason or "absent", tier=tier)
            first = spec.start // self.kv_block
            return OpenLoad(spec, hit, end, first, spec.start - first * self.kv_block,
                            spec.block_ids[: (end - spec.start) // self.engine_block], reason, t0)
        except Exception:  # noqa: BLE001 - a request never fails because of kvwarm
            log.exception("kvwarm load for request %s failed; vLLM recomputes it", spec.req_id)
            if hit is not None:
                hit.release()
            return LoadResult(spec.req_id, 0, planned, reason="error")

    def _write_layer(self, op: OpenLoad, index: int) -> None:
        """Write one layer of an open load into its engine blocks (on a GPU: its bytes moved and dequantised there)."""
        assert self.layout is not None
        tokens = op.end - op.first * self.kv_block
        # this worker's share only: its layers (a pipeline stage's), its heads (a tensor-parallel rank's)
        if op.kv is None and self.caches[index].device.type == "cpu":  # all its layers at once: the CPU's fastest
            # (straight into the blocks where the load runs in the step; on a thread, a deadline stops it between layers)
            if self._scatter and self.fences.thread is None and op.hit.into_cpu_blocks(
                    self.caches, self.layout, op.ids, first_block=op.first, tokens=tokens, layers=self._layers,
                    heads=self._heads, skip=op.offset):
                op.kv = []  # every layer written, straight into its blocks
            else:
                op.kv = op.hit.dequantized(self.layout.dtype, first_block=op.first, tokens=tokens,
                                           layers=self._layers, heads=self._heads)
        if op.kv is not None and not op.kv:
            return
        if op.kv is not None:
            k, v = op.kv[2 * index], op.kv[2 * index + 1]
        else:
            cache = self.caches[index]
            op.device_ids = block_ids(op.ids, cache.device) if op.device_ids is None else op.device_ids
            if self._scatter and op.hit.scatter(  # stored bytes moved, dequantised into the blocks, chunk by chunk
                    cache, self.layout, op.device_ids, first_block=op.first, blocks=-(-tokens // self.kv_block),
                    layer=self._layers[index], heads=self._heads, skip=op.offset // self.engine_block):
                return
            k, v = op.hit.dequantized(self.layout.dtype, first_block=op.first, tokens=tokens,
                                      device=cache.device, layers=[self._layers[index]], heads=self._heads)
        self._write(self.caches[index], op.ids, k[:, op.offset:], v[:, op.offset:])

    def _close(self, op: OpenLoad) -> LoadResult:
        """Release an open load's hit; what it loaded."""
        spec = op.spec
        end = op.end if op.fail_from is None else spec.start + op.fail_from * self.engine_block
        span = range(op.first, -(-op.end // self.kv_block))
        nbytes = sum(op.hit.snapshots[b].nbytes for b in span) if not op.hit.released else 0
        tier = op.hit.tier
        op.hit.release()
        op.kv = None
        reason = None if end == spec.end else (op.reason or "absent") if op.fail_from is None else "error"
        return LoadResult(spec.req_id, end - spec.start, spec.end - spec.start, reason=reason, tier=tier,
                          nbytes=nbytes, seconds=self.clock() - op.started)

    def after_forward(self, plan: StepPlan) -> None:
        """Copy this step's saves out of the cache for write-back (their valid part), and time the step."""
        self._finish_loads()
        t0 = self.clock()
        try:
            self.ledger.computed()
        except Exception:  # noqa: BLE001 - the ledger cannot follow this step: nothing more is stored
            log.exception("kvwarm: could not follow this step's blocks; write-back stops")
            self.ledger.blind = True
        if self.writer is not None and self.layout is not None:
            specs = [spec for spec in map(self._valid_part, plan.saves) if spec is not None]
            # one gather and quantise per layer for every save; the queue may take only a save's head
            for spec, cut in zip(specs, self.writer.copy_out_step(specs, self.caches) if specs else ()):
                if cut is not None:  # the tail is reported
                    self._report.refused[spec.req_id] = min(cut, self._report.refused.get(spec.req_id, cut))
        tokens = plan.prompt_tokens + plan.other_tokens
        if plan.prompt_tokens >= PREFILL_MIN_TOKENS and plan.prompt_tokens >= PREFILL_SHARE * tokens:
            self._report.forward_tokens = tokens
            self._report.forward_seconds = max(0.0, t0 - self._step_start - self._load_seconds)

    def _valid_part(self, spec: SaveSpec) -> SaveSpec | None:
        """The part of a planned save that holds valid KV (:mod:`store.engines.vllm.validity`), or ``None``.

        A block is kept only if it and every block before it in the request's table are valid
        now; what is cut is counted (``write_back_dropped:invalid``) and reported, so that the
        scheduler plans it again once the engine has recomputed it.
        """
        ratio = self.kv_block // self.engine_block
        end = spec.first + len(spec.block_ids) // ratio
        ok = self.ledger.vouched(spec.req_id, spec.first, spec.block_ids, ratio)
        if ok >= end:
            return spec
        self.counters.add("write_back_dropped", end - max(ok, spec.first), reason="invalid")
        self._report.refused[spec.req_id] = min(ok, self._report.refused.get(spec.req_id, ok))
        if ok <= spec.first:
            return None
        return replace(spec, token_ids=spec.token_ids[: ok * self.kv_block],
                       block_ids=spec.block_ids[: (ok - spec.first) * ratio])

    def take_failed(self) -> set[int]:
        """Engine blocks whose load failed this step (vLLM recomputes them)."""
        self._finish_loads()
        failed, self._failed = self._failed, set()
        return failed

    def take_finished_loads(self) -> set[str]:
        """Requests whose deferred (async) loads ended this step, well or not (vLLM's ``finished_recving``)."""
        self._finish_loads()
        done, self._finished_loads = self._finished_loads, set()
        return done

    def take_report(self) -> WorkerReport | None:
        """The step's report for the scheduler (``None`` when there is nothing to say)."""
        self._finish_loads()
        report, self._report = self._report, WorkerReport()
        return report if report.loads or report.forward_tokens or report.refused else None

    # -- start-up and shutdown -----------------------------------------------
    def close(self) -> None:
        """Finish the loads in flight, write what is queued, then release the loaders (their pins and pool slot)."""
        self._finish_loads()
        self.fences.close()
        if self.writer is not None:
            self.writer.close()
        with self._lock:
            loaders, self._loaders = list(self._loaders.values()), {}
        for ld in loaders:
            ld.close()
