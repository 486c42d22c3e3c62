"""The prefill job: compute the missing blocks of planned prefixes and write snapshots.

``Prefiller(loaded, store, options).run(requests)``:

1. keys every prefix's full blocks (the final partial block is never stored: see
   :func:`store.identity.keys.block_chain`) and asks the store how many leading blocks exist;
2. merges what is missing into segments (``prefill.schedule``), so a system prompt
   shared by many prefixes is computed once, and continues each segment from its
   parent's KV (computed in this run) or from the stored KV (loaded from the store);
3. runs batches of segments of equal past length in priority order, and hands each
   batch's KV to :class:`prefill.block_writer.BlockWriter`, which writes one snapshot
   per block through the store (each write is atomic, so nothing partial is ever visible);
4. never starts a batch that its measured rate says cannot finish before the
   deadline (a batch that does not fit is halved first), and halves a batch that runs
   out of GPU memory.

A rerun skips everything that exists, so a killed job resumes where it stopped.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from prefill.block_writer import BlockWriter
from prefill.models import LoadedModel
from prefill.progress import Progress
from prefill.schedule import Batch, PrefixJob, Segment, build_segments, plan_batches, split
from store.errors import BadInputError, KvwarmError, OperationalError, StoreError
from store.format.precision import Precision
from store.identity.keys import block_chain
from store.identity.tenant import Tenant
from store.tiers.store import Store

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [kv_heads, tokens, head_dim]


class PrefillError(KvwarmError):
    """Base class of the prefill job's errors (each says what to change)."""


class DeadlinePassed(PrefillError, OperationalError):
    """The deadline is already past, or too near for any batch: nothing was written."""


class PrefixTooShort(PrefillError, BadInputError):
    """A prefix has no full block to store."""


class OutOfMemory(PrefillError, OperationalError):
    """One segment alone does not fit in the device's memory (batches are halved down to one first)."""


@dataclass(frozen=True)
class PrefixRequest:
    """One prefix to warm for one tenant, already tokenised."""

    tenant: Tenant
    token_ids: tuple[int, ...]
    ttl_s: float
    chat: bool = False
    order: int = 0


@dataclass(frozen=True)
class PrefillOptions:
    """How the job runs: storage precision, block size, batching, the deadline.

    Attributes:
        deadline: Unix seconds by which the job must have finished (the end of the
            off-peak window); ``None`` for no deadline.
        safety: factor applied to every batch's estimated duration.
        max_batch_tokens: padded tokens per batch (bounds activation memory).
        max_batch_size: segments per batch.
        write_threads: threads encoding and writing a batch's snapshots (checksums and
            file writes release the GIL; 1, the default, writes them one by one: 4 gained
            nothing on the H200 host, whose memory bandwidth bounds the checksums and writes).
    """

    precision: Precision
    block_size: int
    deadline: float | None = None
    safety: float = 1.25
    max_batch_tokens: int = 8192
    max_batch_size: int = 64
    write_threads: int = 1


@dataclass
class PrefillReport:
    """What a run did (printed by the CLI, persisted by the flows)."""

    prefixes: int = 0
    blocks_total: int = 0
    blocks_stored_before: int = 0
    blocks_written: int = 0
    blocks_skipped: int = 0
    tokens_computed: int = 0
    forward_tokens: int = 0
    batches: int = 0
    oom_splits: int = 0
    deadline_splits: int = 0
    reloaded_failures: int = 0
    seconds: float = 0.0
    stopped: str | None = None
    blocks_left: int = 0
    quant_error_max: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_computed / self.seconds if self.seconds > 0 else 0.0

    def add(self, run: PrefillReport) -> None:
        """Add what a further ``run`` did (a step of a longer job, as in :mod:`prefill.shard_job`).

        Only the work counters add up; the counts of the prefixes' blocks (``prefixes``,
        ``blocks_total``, ``blocks_stored_before``, ``blocks_left``) overlap between runs and
        stay the caller's to set.
        """
        for name in _WORK_COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(run, name))
        self.quant_error_max = max(self.quant_error_max, run.quant_error_max)
        self.stopped = run.stopped or self.stopped

    def as_dict(self) -> dict[str, object]:
        d = dict(self.__dict__)
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        return d


_WORK_COUNTERS = ("blocks_written", "blocks_skipped", "tokens_computed", "forward_tokens", "batches", "oom_splits",
                  "deadline_splits", "reloaded_failures", "seconds")


@dataclass
class _Rate:
    """Measured compute rate in cost units (see :meth:`Batch.cost`) per second."""

    units_per_s: float | None = None
    samples: list[float] = field(default_factory=list)

    def observe(self, units: float, seconds: float) -> None:
        r = units / max(seconds, 1e-6)
        self.samples.append(r)
        # the slowest of the last few batches: estimates should err on the late side
        self.units_per_s = min(self.samples[-4:])

    def estimate(self, units: float) -> float | None:
        return None if self.units_per_s is None else units / self.units_per_s


def check_deadline(deadline: float | None, now: float) -> None:
    """Raise :class:`DeadlinePassed` when ``deadline`` is set and not after ``now``."""
    if deadline is not None and now >= deadline:
        raise DeadlinePassed(f"the deadline {_fmt_time(deadline)} is already past (now {_fmt_time(now)}); "
                             f"nothing was computed or written")


def _oom_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = []
    for mod, name in ((torch, "OutOfMemoryError"), (torch.cuda, "OutOfMemoryError")):
        e = getattr(mod, name, None)
        if isinstance(e, type) and e not in errs:
            errs.append(e)
    return tuple(errs)


class Prefiller:
    """Runs prefill jobs for one model against one store."""

    def __init__(self, loaded: LoadedModel, store: Store, options: PrefillOptions, *,
                 clock: Callable[[], float] = time.time, progress: Progress | None = None) -> None:
        options.precision.check_layers(loaded.num_layers, model=f"model {loaded.name!r}")  # now the model is known
        self.loaded = loaded
        self.store = store
        self.options = options
        self.clock = clock
        self.progress = progress
        self.writer = BlockWriter(store, options.precision, options.block_size, options.write_threads)
        self.rate = _Rate()
        self._oom = _oom_errors()

    # -- planning -----------------------------------------------------------------
    def jobs(self, requests: Sequence[PrefixRequest]) -> list[PrefixJob]:
        """Key each request's full blocks and probe the store for the stored prefix."""
        opts = self.options
        out = []
        for r in requests:
            root = self.loaded.key_root(opts.precision, opts.block_size, r.tenant.salt, chat=r.chat)
            blocks = tuple(block_chain(root, r.token_ids))
            if not blocks:
                raise PrefixTooShort(f"a prefix of {len(r.token_ids)} tokens is shorter than one block "
                                     f"({opts.block_size} tokens): nothing to store; lower kv_cache.block_size or drop it")
            stored = self.store.probe(r.tenant, blocks, root).count
            out.append(PrefixJob(tenant=r.tenant.name, root=root, blocks=blocks, stored=stored, ttl_s=r.ttl_s,
                                 order=r.order))
        return out

    # -- running ------------------------------------------------------------------
    def run(self, requests: Sequence[PrefixRequest]) -> PrefillReport:
        """Compute and store every missing block of ``requests`` (see the module doc)."""
        t_start = time.perf_counter()
        report = PrefillReport(prefixes=len(requests))
        check_deadline(self.options.deadline, self.clock())
        tenants = {r.tenant.name: r.tenant for r in requests}
        jobs = self.jobs(requests)
        report.blocks_total = len({b.key for j in jobs for b in j.blocks})
        report.blocks_stored_before = len({b.key for j in jobs for b in j.blocks[: j.stored]})
        segments = build_segments(jobs)
        total_tokens = sum(s.n_tokens for s in segments.values())
        if self.progress is not None:
            self.progress.start(total_tokens)
        kept: dict[int, KV] = {}            # KV of finished segments whose children are pending
        pending_children = {s.id: len(s.children) for s in segments.values()}
        done: set[int] = set()
        ready = [s.id for s in segments.values() if s.parent is None]
        while ready and report.stopped is None:
            queue = deque(plan_batches(segments, ready, max_batch_tokens=self.options.max_batch_tokens,
                                       max_batch_size=self.options.max_batch_size))
            ready = []
            while queue:
                batch = queue.popleft()
                fits = self._fits(batch)
                if not fits:
                    if len(batch.segments) > 1 and self.rate.units_per_s is not None:
                        queue.extendleft(reversed(split(batch, segments)))
                        report.deadline_splits += 1
                        continue
                    report.stopped = "deadline"
                    break
                try:
                    finished = self._run_batch(batch, segments, kept, tenants, report)
                except self._oom:
                    if len(batch.segments) < 2:
                        raise OutOfMemory(f"out of GPU memory on a single segment of {batch.max_tokens} tokens "
                                          f"after {batch.past_tokens} past tokens; use a smaller dtype or model") from None
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    self.options = _with(self.options, max_batch_size=max(1, len(batch.segments) // 2))
                    queue.extendleft(reversed(split(batch, segments)))
                    report.oom_splits += 1
                    log.warning("out of memory on a batch of %d segments: halving to %d", len(batch.segments),
                                self.options.max_batch_size)
                    continue
                for sid in finished:
                    done.add(sid)
                    ready.extend(segments[sid].children)
                    par = segments[sid].parent
                    if par is not None:
                        pending_children[par] -= 1
                        if pending_children[par] == 0:
                            kept.pop(par, None)
        left = [s for s in segments.values() if s.id not in done]
        report.blocks_left = sum(len(s.blocks) for s in left)
        report.seconds = time.perf_counter() - t_start
        if self.progress is not None:
            self.progress.finish()
        if report.stopped == "deadline" and report.blocks_written == 0 and report.blocks_left:
            raise DeadlinePassed(self._deadline_message(report))
        return report

    def _fits(self, batch: Batch) -> bool:
        dl = self.options.deadline
        if dl is None:
            return True
        remaining = dl - self.clock()
        if remaining <= 0:
            return False
        est = self.rate.estimate(batch.cost())
        if est is None:
            est = self._calibrate(batch)
        return est * self.options.safety <= remaining

    def _calibrate(self, batch: Batch) -> float:
        """Before the first batch: time one small forward pass to estimate the rate."""
        n = min(batch.max_tokens, 64)
        ids = torch.zeros((1, n), dtype=torch.long, device=self.loaded.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.loaded.model(ids, use_cache=False)
        dt = time.perf_counter() - t0
        self.rate.observe(Batch((0,), 0, n).cost(), dt)
        return self.rate.estimate(batch.cost()) or 0.0

    def _deadline_message(self, report: PrefillReport) -> str:
        dl = self.options.deadline or 0.0
        rate = self.rate.units_per_s or 0.0
        return (f"the deadline {_fmt_time(dl)} is too near: the next batch needs about "
                f"{self.options.safety:.2f} x its estimated time at the measured rate ({rate:,.0f} token units/s) and "
                f"only {max(0.0, dl - self.clock()):.1f} s remain; nothing was written "
                f"({report.blocks_left} block(s) left to compute)")

    def _past(self, seg: Segment, kept: dict[int, KV], tenant: Tenant, report: PrefillReport) -> KV | None:
        """The KV before ``seg``: its parent's (this run) or the stored blocks' (loaded)."""
        if seg.parent is not None:
            return kept[seg.parent]
        if not seg.stored_prefix:
            return None
        dtype = self.loaded.dtype
        per_layer: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(self.loaded.num_layers)]
        for b in seg.stored_prefix:
            try:
                snap = self.store.get(tenant, b, seg.root)
            except StoreError as exc:
                log.warning("stored block %d of a prefix cannot be read (%s); recomputing it", b.index, exc)
                snap = None
            if snap is None:
                return _RECOMPUTE
            try:
                for i in range(self.loaded.num_layers):
                    k, v = snap.layer(i, dtype)
                    per_layer[i][0].append(k.to(self.loaded.device))
                    per_layer[i][1].append(v.to(self.loaded.device))
            finally:
                snap.close()
        return [(torch.cat(ks, dim=1), torch.cat(vs, dim=1)) for ks, vs in per_layer]

    def _run_batch(self, batch: Batch, segments: dict[int, Segment], kept: dict[int, KV],
                   tenants: dict[str, Tenant], report: PrefillReport) -> list[int]:
        """Run one batch; returns the ids of the segments it finished."""
        from transformers import DynamicCache

        t0 = time.perf_counter()
        segs = [segments[s] for s in batch.segments]
        pasts = []
        for seg in segs:
            past = self._past(seg, kept, tenants[seg.tenant], report)
            if past is _RECOMPUTE:
                # a stored block vanished or is bad: compute this segment from block 0
                report.reloaded_failures += 1
                seg.blocks = list(seg.stored_prefix) + seg.blocks
                seg.start, seg.stored_prefix = 0, ()
                past = None
            pasts.append(past)
        if len({s.past_tokens for s in segs}) > 1:
            # a fallback above changed one segment's past: run the others and requeue it
            keep = [s.id for s in segs if s.past_tokens == segs[0].past_tokens]
            rest = [s.id for s in segs if s.past_tokens != segs[0].past_tokens]
            return (self._run_batch(Batch(tuple(keep), segs[0].past_tokens, max(segments[i].n_tokens for i in keep)),
                                    segments, kept, tenants, report)
                    + self._run_batch(Batch(tuple(rest), 0, max(segments[i].n_tokens for i in rest)),
                                      segments, kept, tenants, report))
        past_len = segs[0].past_tokens
        L = max(s.n_tokens for s in segs)
        pad = self.loaded.tokenizer.pad_token_id or 0
        ids = torch.full((len(segs), L), pad, dtype=torch.long)
        for j, s in enumerate(segs):
            toks = s.token_ids
            ids[j, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        cache = None
        if past_len:
            cache = DynamicCache(config=self.loaded.config)
            for i in range(self.loaded.num_layers):
                k = torch.stack([p[i][0] for p in pasts])
                v = torch.stack([p[i][1] for p in pasts])
                cache.update(k, v, layer_idx=i)
        with torch.inference_mode():
            out = self.loaded.model(ids.to(self.loaded.device), cache=cache, use_cache=True)
        layers = out.cache.layers
        report.forward_tokens += int(ids.numel())
        report.batches += 1
        wrote = self.writer.write(layers, segs, past_len, tenants, self.clock())
        report.blocks_written += wrote.written
        report.blocks_skipped += wrote.skipped
        report.quant_error_max = max(report.quant_error_max, wrote.quant_error_max)
        for j, s in enumerate(segs):
            report.tokens_computed += s.n_tokens
            if s.children:
                end = past_len + s.n_tokens
                kept[s.id] = [(layer.keys[j, :, :end].clone(), layer.values[j, :, :end].clone()) for layer in layers]
            if self.progress is not None:
                self.progress.advance(s.n_tokens)
        self.rate.observe(batch.cost(), time.perf_counter() - t0)
        return [s.id for s in segs]


_RECOMPUTE: KV = []  # sentinel: the stored past could not be loaded


def _with(opts: PrefillOptions, **changes: object) -> PrefillOptions:
    from dataclasses import replace

    return replace(opts, **changes)  # type: ignore[arg-type]


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
