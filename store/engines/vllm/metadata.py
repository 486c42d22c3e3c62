"""What crosses between the connector's two roles each step (pickled by vLLM between processes).

Scheduler -> worker: a :class:`StepPlan` (vLLM's ``KVConnectorMetadata``): the loads (which
request, whose tenant, which stored chain, which tokens into which engine blocks) and the saves
(which full prompt blocks of which engine blocks to write back). Worker -> scheduler: a
:class:`WorkerReport` (vLLM's ``KVConnectorWorkerMetadata``): how each load went and how long the
step's forward took, so that the scheduler's estimates follow what this engine measures.

Token ranges are in prompt tokens; ``block_ids`` are vLLM's block ids (neither ordered nor
contiguous), one per engine block. Frozen dataclasses of plain values: no vLLM here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from store.engines.vllm.decodes import NO_DECODES, Decodes
from store.engines.vllm.validity import Compute


@dataclass(frozen=True)
class LoadSpec:
    """Load stored tokens ``start..end`` of one request into its engine blocks.

    Attributes:
        req_id: vLLM's request id.
        tenant: whose keys (the tenant's own chain, or ``public`` through it).
        chat: whether the chain is keyed with the model's chat-template hash.
        token_ids: the prompt's tokens up to the end of the last stored block needed: the chain
            the worker looks up (from its first block: a chain is keyed from its root).
        start: the first token to load (vLLM's own prefix-cache hit; a multiple of its block size).
        end: one past the last token to load (a multiple of the engine block size).
        block_ids: the engine blocks that receive tokens ``start..end``, in order.
        deferred: the request waits for this load (vLLM's async load): the worker reports it
            finished (``get_finished``), and vLLM schedules the request's compute after that.
    """

    req_id: str
    tenant: str
    chat: bool
    token_ids: tuple[int, ...]
    start: int
    end: int
    block_ids: tuple[int, ...]
    deferred: bool = False


@dataclass(frozen=True)
class SaveSpec:
    """Write one request's full prompt blocks ``first..first+count`` to the store.

    Attributes:
        req_id: vLLM's request id.
        tenant: the tenant whose namespace they go to (never ``public``).
        chat: whether they extend the tenant's chat-keyed chain (the one the request's hit was in).
        first: the index of the first kvwarm block to write.
        token_ids: the prompt's tokens up to the end of the last block written (the keys chain from the root).
        block_ids: the engine blocks holding those kvwarm blocks, in token order.
    """

    req_id: str
    tenant: str
    chat: bool
    first: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """The connector's plan for one engine step.

    Attributes:
        loads: what to load before the forward.
        saves: what to copy out after it, for write-back.
        prompt_tokens: prompt tokens the step computes (the worker times steps that are mostly prefill).
        other_tokens: the other tokens it computes (decode).
        computes: every scheduled request's part of the step (what it attends to and writes), for
            the worker's :class:`store.engines.vllm.validity.BlockLedger`; ``None`` when the
            scheduler could not say (the worker then stores nothing more) ...
        decodes: ... but for the steady decodes (no new block), told in bulk, after ``computes``.
        copies: vLLM's ``(src, dst)`` block copies of the step.
        ended: requests whose blocks vLLM took back since the last step (finished, preempted).
    """

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    prompt_tokens: int = 0
    other_tokens: int = 0
    computes: tuple[Compute, ...] | None = ()
    decodes: Decodes = NO_DECODES
    copies: tuple[tuple[int, int], ...] = ()
    ended: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadResult:
    """How one load went.

    Attributes:
        req_id: the request.
        loaded: tokens written into its blocks, from the load's ``start`` (all of them when it worked).
        planned: tokens the plan asked for.
        reason: why fewer (a loader miss reason: ``corrupt``, ``expired``, ``absent``...), else ``None``.
        tier: where the snapshots came from (``pool``, ``nvme``).
        nbytes: stored bytes read.
        seconds: time from mapping to the last write into the engine's blocks.
    """

    req_id: str
    loaded: int
    planned: int
    reason: str | None = None
    tier: str = "nvme"
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class WorkerReport:
    """What the worker tells the scheduler after a step (several workers' reports aggregate).

    Attributes:
        loads: one result per load of the step.
        forward_tokens: tokens of a step that was mostly prefill, else 0.
        forward_seconds: how long its forward took (its loads excluded).
        refused: per request, the first kvwarm block of its saves that was not stored because
            it (or a block before it) did not hold valid KV, or did not fit in the write-back
            queue; the scheduler plans it again once the request computes prompt tokens again.
    """

    loads: list[LoadResult] = field(default_factory=list)
    forward_tokens: int = 0
    forward_seconds: float = 0.0
    refused: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: "WorkerReport") -> "WorkerReport":
        """Merge another worker's report of the same step (tensor parallel: each loads its heads).

        A load counts as done only as far as every worker got; the forward took as long as the
        slowest worker.
        """
        mine = {r.req_id: r for r in self.loads}
        for r in other.loads:
            have = mine.get(r.req_id)
            if have is None or r.loaded < have.loaded:
                mine[r.req_id] = r
        self.loads = list(mine.values())
        for req_id, first in other.refused.items():
            self.refused[req_id] = min(first, self.refused.get(req_id, first))
        self.forward_tokens = max(self.forward_tokens, other.forward_tokens)
        self.forward_seconds = max(self.forward_seconds, other.forward_seconds)
        return self
