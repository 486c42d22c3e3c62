"""The connector's scheduler role: count what kvwarm holds for each request, and plan its loads and saves.

It runs in vLLM's scheduler (EngineCore) and never touches KV:

1. ``get_num_new_matched_tokens``: the request's tenant (:mod:`store.engines.vllm.tenancy`), a
   probe of the NVMe tier (:mod:`store.engines.vllm.probe`; kept while the request waits: vLLM
   asks at every step), S3 as ``fetch_mode`` says (:mod:`store.engines.vllm.fetches`), the
   answer in whole engine blocks beyond vLLM's own hit (:mod:`store.engines.vllm.planning`), and
   the cost check (:mod:`store.engines.vllm.costs`). Never raises: trouble answers 0.
2. ``update_state_after_alloc``: the load (tokens and the engine blocks vLLM gave them).
3. ``build_plan`` (vLLM's ``build_connector_meta``): this step's loads, what every scheduled request
   attends to and writes (the worker's block-validity ledger, :mod:`store.engines.vllm.validity`),
   and the write-back saves.
4. ``update_output``: what the worker reported (loads, timings) feeds the counters and estimates.
5. ``request_finished``: what kvwarm did for the request, returned in its ``kv_transfer_params``.

Each request's lookup is counted once, with its outcome (``lookups == hits + misses``): a miss
when it is answered 0 (a miss of the tenant's own chains after the cross-tenant check,
:mod:`store.engines.vllm.audit`, off the request path), a hit only when the worker reports tokens
loaded, a miss under the worker's reason when a load wrote nothing. What a client is told
never names a tenant or a tenancy reason (:func:`store.engines.vllm.tenancy.client_reason`).

A planned load is always sent to the worker, which either loads it or reports its blocks
failed (vLLM then recomputes them): a request never computes over blocks nobody wrote.
"""
from __future__ import annotations

import logging
import time
from operator import itemgetter
from typing import Any, Callable, Mapping, Sequence

from store.engines.vllm.audit import Check, CrossTenantAudit
from store.engines.vllm.costs import CostModel, default_prefill
from store.engines.vllm.fetches import RemoteFetches
from store.engines.vllm.memory import EngineMemory
from store.engines.vllm.metadata import LoadSpec, SaveSpec, StepPlan, WorkerReport
from store.engines.vllm.nodes import node_client
from store.engines.vllm.planning import (
    computes_of,
    kv_blocks_spanned,
    load_spec,
    matched_tokens,
    stored_block_bytes,
)
from store.engines.vllm.probe import ProbeHit, StoreProbe
from store.engines.vllm.saves import SavePlanner
from store.engines.vllm.settings import ConnectorSettings, check_block_sizes
from store.engines.vllm.stats import Counters, merge
from store.engines.vllm.tenancy import TENANCY_REASONS, TenantBook, client_reason
from store.engines.vllm.tracker import RequestState, Tracker
from store.identity.fingerprint import ModelIdentity
from store.identity.tenant import PUBLIC
from store.tiers.registry import tiers_from_url
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")
#: Most finished requests whose load the worker has not reported yet (vLLM reports after it finishes them).
MAX_FINISHING = 4096


class SchedulerRole:
    """Everything the scheduler side of :class:`store.engines.vllm.KvwarmConnector` does.

    Args:
        settings: the checked extra config.
        identities: the model's plain and chat-keyed identities.
        engine_block: vLLM's block size.
        layers, kv_heads, head_dim: the model's KV geometry (all heads: what a snapshot holds).
        hf_config: the model's config numbers (the default prefill estimate).
        cpu: whether the engine runs on the CPU (the default prefill estimate).
        tp_size: tensor-parallel workers (write-back needs every head in one worker: 1).
        async_loads: a request waits a step for its load (vLLM's ``load_kv_async``) instead of
            computing in the step that loads it (see ``ConnectorSettings.load_mode``).
        clock: monotonic time (S3 waits).
    """

    def __init__(self, settings: ConnectorSettings, *, identities: tuple[ModelIdentity, ModelIdentity | None],
                 engine_block: int, layers: int, kv_heads: int, head_dim: int,
                 hf_config: Mapping[str, Any] | None = None, cpu: bool = True, tp_size: int = 1,
                 async_loads: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        cfg = settings.config
        self.async_loads = async_loads
        self.loads = settings.loads
        self.kv_block = cfg.kv_cache.block_size
        self.engine_block = engine_block
        self.ratio = check_block_sizes(self.kv_block, engine_block)
        self.tenants = TenantBook(cfg, settings.tenant)
        tiers = tiers_from_url(settings.store_url, cfg.store)
        precision = cfg.kv_cache.precision()
        self.node = node_client(settings)
        self.probe = StoreProbe(Store(tiers[:1]), identities, precision, self.kv_block, self.tenants,
                                public_prefixes=cfg.loader.public_prefixes, node=self.node)
        self.memory = EngineMemory.open(settings, tiers, self.probe, self.node)
        self.fetches = RemoteFetches(Store(tiers), self.tenants, mode=cfg.loader.fetch_mode,
                                     timeout_s=cfg.loader.sync_fetch_timeout_s, backoff_s=cfg.loader.s3_backoff_s,
                                     workers=cfg.loader.fetch_workers, gets=cfg.loader.chain_gets, node=self.node,
                                     clock=clock)
        self.costs = CostModel(default_prefill(hf_config, cpu=cpu), tokens_per_s=settings.prefill_tokens_per_s)
        self.block_bytes = stored_block_bytes(precision, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                              kv_block=self.kv_block)
        self.write_back = settings.write_back and tp_size == 1
        self.saves = SavePlanner(write_back=self.write_back, kv_block=self.kv_block, engine_block=engine_block)
        if settings.write_back and tp_size > 1:
            log.warning("kvwarm write-back is off: with %d tensor-parallel workers no worker holds every KV head",
                        tp_size)
        if self.write_back and settings.tenant == PUBLIC:
            log.warning("kvwarm writes back no request of tenant 'public' (its prefixes serve every tenant): set "
                        "kv_connector_extra_config.tenant, or give requests a tenant, to write back")
        self.clock = clock
        self.counters = Counters()
        self.audit = CrossTenantAudit(self.probe, self.counters)
        self.tracker = Tracker()
        self._finishing: dict[str, RequestState] = {}  # finished, their load not reported yet
        self._named_warned = False
        self._loads: list[LoadSpec] = []
        self._worker_totals: dict[str, Any] = {}

    # -- per request ---------------------------------------------------------
    def on_new_request(self, request: Any) -> RequestState:
        """Resolve the request's tenant and start its state.

        A request whose KV depends on more than its token ids (images or other multimodal inputs,
        a LoRA adapter, prompt embeddings) gets nothing from kvwarm (``unsupported``): kvwarm's keys
        name tokens only, so a hit could hand it KV computed for other inputs.
        """
        if getattr(request, "mm_features", None) or getattr(request, "lora_request", None) is not None \
                or getattr(request, "prompt_embeds", None) is not None:
            return self.tracker.add(RequestState(req_id=request.request_id, prompt=(), tenant=None,
                                                 refusal="unsupported"))
        who = self.tenants.resolve(getattr(request, "cache_salt", None), getattr(request, "kv_transfer_params", None))
        if who.name is None:  # a refused claim is suspicious; a salt kvwarm does not map is a configuration choice
            level = logging.WARNING if who.refusal == "tenant_refused" else logging.DEBUG
            if who.refusal == "tenant_unverified" and not self._named_warned:
                self._named_warned, level = True, logging.WARNING  # once: a gateway that names tenants by name
                log.warning("kvwarm: requests name a tenant in kv_transfer_params without its cache_salt and get "
                            "nothing; give them the tenant's cache_salt, or set tenants.trust_named when a trusted "
                            "gateway sets the name (docs/guides/engines.md)")
            log.log(level, "request %s gets nothing from kvwarm (%s): %s", request.request_id, who.refusal, who.detail)
        return self.tracker.add(RequestState(req_id=request.request_id, prompt=tuple(request.prompt_token_ids or ()),
                                             tenant=who.name, refusal=who.refusal))

    def _state(self, request: Any) -> RequestState:
        return self.tracker.get(request.request_id) or self.on_new_request(request)

    def _miss(self, st: RequestState, reason: str, *, audit: bool = False, shown: str | None = None) -> None:
        """Resolve the request's lookup as a miss under ``reason``, once; the client is told ``shown``
        (default: :func:`client_reason`).

        ``audit``: nothing of the prompt is stored for the request's tenant; the cross-tenant check
        runs after the answer and counts the miss (``tenant_refused`` when another tenant holds it).
        """
        if st.counted:
            return
        st.counted = True
        st.reason = shown or client_reason(reason)
        if audit and st.tenant is not None:
            self.audit.submit(Check(st.req_id, st.tenant, st.prompt[: self.kv_block], reason))
        else:
            self.counters.add_many(("lookups", None), ("misses", reason))

    def _hit(self, st: RequestState) -> None:
        """Resolve the request's lookup as a hit (the worker loaded tokens for it), once."""
        if st.counted:
            return
        st.counted = True
        counts: list[tuple[str, str | None]] = [("lookups", None), ("hits", None)]
        if st.fetch_reason is not None:
            counts.append(("shortened", st.fetch_reason))
        self.counters.add_many(*counts)

    def get_num_new_matched_tokens(self, request: Any, computed: int) -> tuple[int | None, bool]:
        """Stored tokens beyond vLLM's ``computed`` ones that the worker will load before the forward.

        ``(None, False)`` while the request waits for an S3 copy; ``(0, False)`` for a miss or any trouble.
        """
        try:
            return self._matched(request, computed)
        except Exception:  # noqa: BLE001 - a request never fails because of kvwarm
            log.exception("kvwarm lookup failed for request %s; served cold", getattr(request, "request_id", "?"))
            return 0, False

    def _matched(self, request: Any, computed: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.answer, st.asked = 0, True
        if st.tenant is None:
            # told what a tenant with nothing stored is told: the same words as the probe's
            short = len(st.prompt) < max(2, self.kv_block)
            self._miss(st, st.refusal or "error", shown=st.refusal if st.refusal not in TENANCY_REASONS else
                       "short_prompt" if short else "absent")
            return 0, False
        if not self.loads:  # load_mode off: this engine only writes back
            self._miss(st, "loads_off")
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):
            # vLLM overrides any answer with 0 for it (prompt logprobs...): nothing is probed or counted as a hit
            self._miss(st, "skip_reading_prefix_cache")
            return 0, False
        if st.load_failed:
            # vLLM frees the blocks of a request whose async load got nothing and asks again: the same answer
            # would plan the same load, which fails the same way at every step, and the request never computes
            return 0, False
        if st.hit is None or st.pending is not None:
            if self._look(st) is None:
                return None, False
        hit = st.hit
        assert hit is not None
        n = matched_tokens(hit.blocks, kv_block=self.kv_block, engine_block=self.engine_block,
                           prompt_tokens=len(st.prompt), computed=computed)
        if n == 0:
            if hit.blocks == 0:
                reason = st.fetch_reason or hit.reason or "absent"
            else:  # vLLM's own cache holds all a load could give, or the prompt leaves no whole block to load
                usable = matched_tokens(hit.blocks, kv_block=self.kv_block, engine_block=self.engine_block,
                                        prompt_tokens=len(st.prompt), computed=0)
                reason = "engine_cached" if usable and computed >= usable else "short_prompt"
            self._miss(st, reason, audit=hit.blocks == 0 and hit.reason == "absent")
            return 0, False
        span = kv_blocks_spanned(computed, computed + n, self.kv_block)
        if not self.costs.worth_loading("nvme", cached_tokens=computed, hit_tokens=n,
                                        nbytes=len(span) * self.block_bytes, files=len(span)):
            self._miss(st, "slower_than_prefill")
            return 0, False
        st.computed, st.answer = computed, n  # a hit once the worker reports the load
        return n, self.async_loads

    def _look(self, st: RequestState) -> ProbeHit | None:
        """Probe NVMe (again after an S3 copy); ``None`` while the request should wait for S3."""
        assert st.tenant is not None
        if st.pending is not None:
            if st.pending.waiting(self.clock()):
                st.pending.pause()
                if st.pending.waiting(self.clock()):
                    return None
            future, st.pending = st.pending.future, None
            why: str | None = "fetch_timeout"  # it goes on in the background: next time it is local
            if future.done():
                try:
                    why = future.result()[1]  # why the copy got less than the chain (store_unavailable...)
                except BaseException:  # noqa: BLE001 - cancelled, or a bug in the copy: a miss all the same
                    why = "error"
            st.hit = self.probe.probe(st.tenant, st.prompt)
            st.fetch_reason = why if st.hit.blocks < st.hit.full_blocks else None
            self.saves.where(st)
            return st.hit
        hit = st.hit = self.probe.probe(st.tenant, st.prompt)
        self.saves.where(st)
        if hit.blocks < hit.full_blocks and hit.reason in (None, "absent") and self.fetches.has_remote:
            if not self.fetches.usable(st.tenant):
                st.fetch_reason = "store_unavailable"
                return hit
            ns, chat = (hit.namespace, hit.chat) if hit.blocks else (st.tenant, False)
            scope = self.probe.scope(ns, chat)
            chain = self.probe.chain(ns, chat, st.prompt)
            missing = hit.full_blocks - hit.blocks
            if self.fetches.mode == "sync" and self.costs.load_seconds("s3", missing * self.block_bytes, missing) \
                    < self.costs.prefill_seconds(hit.full_blocks * self.kv_block, hit.blocks * self.kv_block):
                st.pending = self.fetches.wait_for(st.tenant, scope, chain)
                if st.pending is not None:
                    return None
            self.fetches.background(st.tenant, scope, chain[hit.blocks:])
            st.fetch_reason = "fetch_scheduled"
        return hit

    def update_state_after_alloc(self, request: Any, block_table: Sequence[int], num_external: int) -> None:
        """vLLM allocated ``block_table`` (all the request's blocks); plan the load of ``num_external`` tokens."""
        st = self._state(request)
        st.block_table = list(block_table)
        if num_external <= 0:
            if st.answer > 0 and st.planned == 0:  # vLLM took none of it: its own cache holds that much
                self._miss(st, "engine_cached")
            return
        start, end = st.computed, st.computed + num_external
        try:
            hit = st.hit
            assert st.tenant is not None and hit is not None
            spec = load_spec(st.req_id, st.tenant, hit.chat, st.prompt, st.block_table, start=start,
                             tokens=num_external, kv_block=self.kv_block, engine_block=self.engine_block,
                             deferred=self.async_loads)
        except Exception:  # noqa: BLE001 - the worker must still hear of these blocks, to fail them
            log.exception("kvwarm could not plan the load of request %s; its blocks are reported failed", st.req_id)
            ids = tuple(st.block_table[start // self.engine_block : end // self.engine_block])
            spec = LoadSpec(st.req_id, st.tenant or PUBLIC, False, (), start, end, ids, deferred=self.async_loads)
        st.in_flight += num_external
        st.planned += num_external
        if not st.matched_counted:  # once: a preempted request allocates (and loads) again
            st.matched_counted = True
            self.counters.add("tokens_matched", num_external)
        self._loads.append(spec)

    # -- per step ------------------------------------------------------------
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's loads (everything allocated since the last step), what it computes, and its saves."""
        loads, self._loads = tuple(self._loads), []
        try:
            computes, decodes, copies, ended = computes_of(scheduler_output)
        except Exception:  # noqa: BLE001 - the worker then stores nothing more; the loads are always sent
            log.exception("kvwarm could not read what this step computes; write-back stops")
            return StepPlan(loads=loads, computes=None)
        saves: list[SaveSpec] = []
        prompt_tokens = 0
        try:
            # every scheduled request, new and resumed first (their whole tables), then the steady decodes in bulk
            for c, st in zip(computes, self.tracker.get_many(map(itemgetter(0), computes))):
                if st is None:
                    continue
                if c.replace:
                    st.block_table = list(c.new_blocks)
                elif c.new_blocks:
                    st.block_table.extend(c.new_blocks)
                prompt_tokens += self.saves.step(st, c.start, c.tokens, saves)
            prompt_tokens += self.saves.decoding(decodes, self.tracker, saves)
            other = max(0, int(scheduler_output.total_num_scheduled_tokens) - prompt_tokens)
        except Exception:  # noqa: BLE001 - saves are best effort; the loads above are always sent
            log.exception("kvwarm could not plan this step's write-back")
            return StepPlan(loads=loads, computes=computes, decodes=decodes, copies=copies, ended=ended)
        return StepPlan(loads=loads, saves=tuple(saves), prompt_tokens=prompt_tokens, other_tokens=other,
                        computes=computes, decodes=decodes, copies=copies, ended=ended)

    def update_output(self, report: WorkerReport | None, worker_stats: Mapping[str, Any] | None) -> None:
        """What the worker reported after a step: each load's outcome, its timings, its counters."""
        if worker_stats:
            merge(self._worker_totals, {k: v for k, v in worker_stats.items() if k != "load_latencies"})
        if report is None:
            return
        for r in report.loads:
            if r.seconds > 0:
                self.costs.observe_load(r.tier, r.nbytes, r.seconds)
            st = self.tracker.get(r.req_id) or self._finishing.pop(r.req_id, None)
            if st is None:
                continue
            st.in_flight = max(0, st.in_flight - r.planned)
            st.loaded += r.loaded
            if r.loaded > 0:
                self._hit(st)
            else:
                self._miss(st, r.reason or "error")
            if r.reason is not None:
                st.reason = client_reason(r.reason)
                st.load_failed = True
                self.saves.load_failed(st, r.loaded)
        for req_id, first in report.refused.items():
            st = self.tracker.get(req_id)
            if st is not None:
                self.saves.refused(st, first)
        if report.forward_tokens:
            self.costs.observe_prefill(report.forward_tokens, report.forward_seconds)

    def request_finished(self, request: Any) -> dict[str, Any]:
        """Forget the request; what kvwarm did for it (its ``kv_transfer_params["kvwarm"]``)."""
        st = self.tracker.drop(request.request_id)
        self.saves.forget(request.request_id)
        if st is None:
            return {}
        if self.memory is not None:
            self.memory.served(st)
        if st.pending is not None:
            st.pending.future.cancel()
        if not st.counted and st.in_flight > 0:
            # vLLM finished it in the step its load ran, and reports the load just after: counted then
            self._finishing[st.req_id] = st
            while len(self._finishing) > MAX_FINISHING:  # a report that never comes: vLLM finishes only loaded ones
                self._hit(self._finishing.pop(next(iter(self._finishing))))
        elif st.asked:
            self._miss(st, "aborted")  # it ended before its answer was allocated (aborted while it waited)
        return {"kvwarm": st.outcome()}

    # -- reporting -----------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int], *, tenant: str | None = None, chat: bool = False) -> list[str]:
        """The keys of the prompt's full kvwarm blocks under ``tenant``'s (default: the default tenant's)
        plain or chat-keyed root, as the probe computes them (``prefill warm`` must compute the same)."""
        return [b.key for b in self.probe.chain(tenant or self.tenants.default, chat, token_ids)]

    def stats(self) -> dict[str, Any]:
        """Every figure since start: this role's counters, the worker's as reported, the estimates.

        Waits up to a second each for the cross-tenant checks still queued (their lookups are counted
        with them) and the finished requests' fleet records; vLLM's per-step figures never wait.
        """
        self.audit.flush(1.0)
        if self.memory is not None:
            self.memory.flush(1.0)
        out = dict(self.counters.totals())
        merge(out, self._worker_totals)
        out["requests_tracked"] = len(self.tracker)
        out["node"] = {"connected": self.node is not None and self.node.connected,
                       "fallbacks": self.probe.node_fallbacks, "fetches_handed": self.fetches.handed,
                       "fleet_records": self.memory.node_records if self.memory is not None else 0}
        out["estimates"] = self.costs.as_dict()
        return out

    def close(self) -> None:
        """Stop the S3 copy threads and the cross-tenant checks, and release the store."""
        self.fetches.close()
        self.audit.close()
        if self.memory is not None:
            self.memory.close()
        self.probe.local.close()
        if self.node is not None:
            self.node.close()
