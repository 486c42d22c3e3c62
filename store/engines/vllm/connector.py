"""``KvwarmConnector``: kvwarm as a vLLM v1 KV connector (one class, two roles).

vLLM makes one instance per role: the scheduler's (in EngineCore) counts and plans
(:class:`store.engines.vllm.scheduler.SchedulerRole`), the worker's (beside the model) moves bytes
(:class:`store.engines.vllm.worker.WorkerRole`). This class only translates vLLM's calls and
objects for them, and keeps every failure away from vLLM: a request never fails because of
kvwarm (a load that fails is reported by block id, and vLLM recomputes it). What can be wrong
before traffic (the extra config, the model, the block sizes, the KV layout, an FP8 engine cache)
stops vLLM's start with a message naming what to change.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from store.engines.vllm.agents import start_agents
from store.engines.vllm.cpu_backend import cpu_block_order, cpu_block_writer
from store.engines.vllm.layout import CPU_BACKEND, detect_layout
from store.engines.vllm.metadata import StepPlan, WorkerReport
from store.engines.vllm.parallel import check_model, order_layers, write_back_refusal
from store.engines.vllm.prom import KvwarmPromMetrics, KvwarmStats
from store.engines.vllm.scheduler import SchedulerRole
from store.engines.vllm.settings import ConnectorConfigError, loads_layer_by_layer, model_identities, parse_settings
from store.engines.vllm.worker import WorkerRole
from store.serving.agent import AgentThread

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvwarm.vllm")


@dataclass(frozen=True)
class KvwarmMetadata(KVConnectorMetadata):
    """Scheduler -> worker, each step: the :class:`store.engines.vllm.metadata.StepPlan`."""

    plan: StepPlan


@dataclass
class KvwarmWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: the :class:`store.engines.vllm.metadata.WorkerReport`."""

    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvwarmWorkerMetadata):
            self.report.aggregate(other.report)
        return self


def _log_where_vllm_logs() -> None:
    """kvwarm's loggers print through vLLM's handlers (vLLM configures only its own loggers)."""
    ours, theirs = logging.getLogger("kvwarm"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


def layer_index(name: str) -> int:
    """A registered KV cache's global layer number by vLLM's rule (its runner's): ``model.layers.16.self_attn.attn``
    -> 16. Raises ``ConnectorConfigError`` for a name with no single layer number."""
    try:
        return extract_layer_index(name)
    except (AssertionError, IndexError, ValueError):
        raise ConnectorConfigError(f"kvwarm connector: the KV cache {name!r} names no single layer number; kvwarm "
                                   "loads snapshot layer N into the cache of layer N and cannot place this one") from None


def _spec_facts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> dict[str, Any]:
    """What :func:`store.engines.vllm.parallel.check_model` needs, read off vLLM's config objects."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    spec, mc = vllm_config.speculative_config, vllm_config.model_config
    return dict(mla=bool(mc.use_mla) or any(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in groups),
                groups=len(groups) if kv_cache_config is not None else 1,
                group_kinds=[type(g.kv_cache_spec).__name__ for g in groups],
                window=next((w for g in groups for w in (getattr(g.kv_cache_spec, "sliding_window", None),
                                                         getattr(g.kv_cache_spec, "attention_chunk_size", None))
                             if w is not None), None),
                speculative=getattr(spec, "method", None), draft_kv=spec is not None and spec.uses_draft_kv_cache(),
                kv_heads=mc.get_total_num_kv_heads(), tp_size=vllm_config.parallel_config.tensor_parallel_size)


class KvwarmConnector(KVConnectorBase_V1):
    """kvwarm's prewarmed KV in vLLM: loads stored prefixes, writes computed ones back (docs/guides/engines.md).

    Start vLLM with ``kv_connector="KvwarmConnector"``, ``kv_connector_module_path="store.engines.vllm"``
    and ``kv_connector_extra_config`` as :mod:`store.engines.vllm.settings` describes.
    """

    _cache_hit_source = CacheHitSource.DISK
    #: The worker role's class (a subclass may wrap its loads, as the fault-injection tests do).
    worker_class: type[WorkerRole] = WorkerRole

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """``True``: vLLM must not replay a forward as one full CUDA graph (it then turns ``FULL_AND_PIECEWISE``
        into ``PIECEWISE``, ``vllm/config/vllm.py``).

        kvwarm loads layer by layer beside the forward, and the forward's stream waits on each layer's event
        in ``wait_for_layer_load``, Python that a full graph's replay skips: attention would read blocks still
        loading, and the KV computed over them would be written back. Both load modes load that way; only
        ``load_mode: off`` (write-back alone) does not ask (:func:`store.engines.vllm.settings.loads_layer_by_layer`).
        docs/guides/engines.md ("CUDA graphs and stream fences") says what piecewise graphs cost.
        """
        return loads_layer_by_layer(extra_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """``False``: kvwarm is a best-effort cache, not a hand-off (vLLM's default is the producer role,
        true for ``kv_both``). A write-back a preemption cuts short is a future miss, so vLLM need not drop
        the preempted request's in-flight output as it must for a disaggregated-prefill transfer."""
        return False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        t0 = time.perf_counter()
        _log_where_vllm_logs()
        mc = vllm_config.model_config
        settings = parse_settings(self._kv_transfer_config.kv_connector_extra_config, served_model=mc.model,
                                  revision=mc.revision)
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype.startswith("fp8"):
            raise ConnectorConfigError(f"kvwarm connector: the engine's KV cache is {cache_dtype}; kvwarm fills "
                                       "bf16/fp16 caches: start vLLM with --kv-cache-dtype auto")
        check_model(mc.model, **_spec_facts(vllm_config, kv_cache_config))
        pc = vllm_config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        why = write_back_refusal(tp, pp) if settings.write_back else None
        if why is not None:
            if role == KVConnectorRole.SCHEDULER:
                log.warning("kvwarm write-back is off: %s", why)
            settings = replace(settings, write_back=False)
        self._identities = model_identities(settings.model_dir)
        fingerprint_s = time.perf_counter() - t0
        self._engine_block = vllm_config.cache_config.block_size
        self._total_kv_heads = mc.get_total_num_kv_heads()
        self._settings = settings
        self._tokenizer: Any = None  # for a plan's text entries, loaded on first use
        self._agents: AgentThread | None = None
        self._scheduler: SchedulerRole | None = None
        self._worker: WorkerRole | None = None
        self._layer_of: dict[str, int] = {}  # registered layer name -> the worker's index of its cache
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # vLLM reads the policy right after making this connector: "fail" would turn a failed
                # kvwarm load into a failed request (empty output), which kvwarm never allows.
                log.warning("kvwarm connector: kv_load_failure_policy %r -> 'recompute' (a failed kvwarm load is "
                            "recomputed, never a failed request)", self._kv_transfer_config.kv_load_failure_policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else None
            text = hf.get("text_config", hf) if isinstance(hf, dict) else None
            self._scheduler = SchedulerRole(
                settings, identities=self._identities, engine_block=self._engine_block,
                layers=mc.get_total_num_hidden_layers(), kv_heads=self._total_kv_heads,
                head_dim=mc.get_head_size(), hf_config=text, cpu=vllm_config.device_config.device_type == "cpu",
                tp_size=tp, async_loads=settings.async_loads(bool(vllm_config.scheduler_config.async_scheduling)))
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
            from vllm.distributed.utils import get_pp_indices

            # the layers of this worker's stage, as the model's make_layers splits them
            self._stage = get_pp_indices(mc.get_total_num_hidden_layers(), get_pp_group().rank_in_group if pp > 1
                                         else 0, pp)
            self._worker = self.worker_class(settings, identities=self._identities, engine_block=self._engine_block,
                                             tp_rank=get_tensor_model_parallel_rank() if tp > 1 else 0, tp_size=tp)
        log.info("kvwarm connector (%s role) ready in %.3f s (model identity %.3f s; store %s, tenant %r, "
                 "write_back %s, %s loads)", role.name.lower(), time.perf_counter() - t0, fingerprint_s,
                 settings.store_url, settings.tenant, settings.write_back,
                 "no" if not settings.loads else "async"
                 if settings.async_loads(bool(vllm_config.scheduler_config.async_scheduling)) else "sync")

    # -- figures -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """kvwarm's figures since start: the scheduler role's include what the workers reported."""
        if self._scheduler is not None:
            return self._scheduler.stats()
        assert self._worker is not None
        return self._worker.counters.totals()

    def block_keys(self, token_ids: list[int], *, tenant: str | None = None, chat: bool = False) -> list[str]:
        """The keys the scheduler role probes for a prompt's full blocks (see ``SchedulerRole.block_keys``)."""
        return self._sched().block_keys(token_ids, tenant=tenant, chat=chat)

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        role = self._scheduler if self._scheduler is not None else self._worker
        data = role.counters.take() if role is not None else {}
        return KvwarmStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> "KVConnectorStats | None":
        return KvwarmStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvwarmPromMetrics:
        return KvwarmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker role ---------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker
        assert worker is not None
        t0 = time.perf_counter()
        model = self._vllm_config.model_config
        group = self._kv_cache_config.kv_cache_groups[0]
        names, layers = order_layers({n: layer_index(n) for n in kv_caches}, model=model.model,
                                     total_layers=model.get_total_num_hidden_layers(), stage=self._stage,
                                     group_layers=group.layer_names)
        tensors = [kv_caches[n] for n in names]
        self._layer_of = {n: i for i, n in enumerate(names)}
        spec = group.kv_cache_spec
        layer = self._vllm_config.compilation_config.static_forward_context.get(names[0])
        backend = layer.attn_backend.get_name() if layer is not None else "unknown"
        isa = getattr(layer, "isa", None)
        heads, block, dim = spec.num_kv_heads, spec.block_size, spec.head_size
        index = None
        writer = cpu_block_writer(isa) if backend == CPU_BACKEND and isinstance(isa, str) else None
        if backend == CPU_BACKEND:
            isa, index = cpu_block_order(isa, heads, block, dim, tensors[0].dtype)
        layout = detect_layout(tensors, backend=backend, isa=isa, num_kv_heads=heads, head_dim=dim,
                               block_size=block, index=index)
        if layout.kind == "cpu_vec":  # the known order, probed: kvwarm writes it itself, straight from the snapshots
            writer = None
        worker.register(tensors, layout, total_kv_heads=self._total_kv_heads, writer=writer, layers=layers,
                        total_layers=model.get_total_num_hidden_layers())
        log.info("kvwarm: %d layers of KV (model layers %d-%d), %s layout (backend %s, %s), %d blocks of %d tokens; "
                 "registered in %.3f s", len(tensors), layers[0], layers[-1], layout.kind, backend,
                 getattr(layer, "isa", None), layout.num_blocks, block, time.perf_counter() - t0)
        # the node agents: the plan (and the fleet's memory) followed for the engine's life
        self._agents = start_agents(worker, self._settings, self._tokenize)

    def _tokenize(self, text: str, chat: bool) -> list[int]:
        """A plan entry's text as ``prefill warm`` tokenised it (through the chat template when ``chat``)."""
        tok = self._tokenizer
        if tok is None:
            from transformers import AutoTokenizer

            tok = self._tokenizer = AutoTokenizer.from_pretrained(self._settings.model_dir)
        if chat:
            ids = tok.apply_chat_template([{"role": "system", "content": text}], tokenize=True,
                                          add_generation_prompt=False)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            return [int(t) for t in ids]
        return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step(self._plan())

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        # metadata of another kind says nothing of what the step computes: the worker then stores nothing more
        return meta.plan if isinstance(meta, KvwarmMetadata) else StepPlan(computes=None)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load(self._plan())  # never raises: failures become failed blocks

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            index = self._layer_of.get(layer_name)
            try:
                if index is None:  # a layer kvwarm did not register: wait for every layer
                    for i in range(len(self._layer_of)):
                        self._worker.wait_layer(i)
                else:
                    self._worker.wait_layer(index)
            except Exception:  # noqa: BLE001 - the forward never fails because of kvwarm
                log.exception("kvwarm: waiting for layer %s's load failed", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are copied out once per step, in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        try:
            self._worker.after_forward(self._plan())
        except Exception:  # noqa: BLE001 - write-back is best effort
            log.exception("kvwarm: copying this step's blocks for write-back failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        loads = self._worker.take_finished_loads() if self._worker is not None else set()
        return None, loads or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._worker.take_report() if self._worker is not None else None
        return KvwarmWorkerMetadata(report) if report is not None else None

    # -- scheduler role ------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        try:
            self._sched().on_new_request(request)
        except Exception:  # noqa: BLE001 - the lookup starts the state again if needed
            log.exception("kvwarm: could not start request %s", request.request_id)

    def _sched(self) -> SchedulerRole:
        assert self._scheduler is not None, "a scheduler-role call on the worker's connector"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return KvwarmMetadata(self._sched().build_plan(scheduler_output))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        try:
            meta = connector_output.kv_connector_worker_meta
            stats = connector_output.kv_connector_stats
            self._sched().update_output(meta.report if isinstance(meta, KvwarmWorkerMetadata) else None,
                                        stats.data if isinstance(stats, KvwarmStats) else None)
        except Exception:  # noqa: BLE001 - figures are best effort
            log.exception("kvwarm: could not take the workers' report")

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        try:
            return False, self._sched().request_finished(request) or None
        except Exception:  # noqa: BLE001 - finishing a request never fails because of kvwarm
            log.exception("kvwarm: could not finish request %s", request.request_id)
            return False, None

    # -- shutdown ------------------------------------------------------------
    def shutdown(self) -> None:
        if self._agents is not None:
            self._agents.close()
        for role in (self._worker, self._scheduler):
            if role is not None:
                try:
                    role.close()
                except Exception:  # noqa: BLE001 - shutting down never fails because of kvwarm
                    log.exception("kvwarm: shutdown of the %s role failed", type(role).__name__)
