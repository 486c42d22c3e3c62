"""The engine's node agents: the worker's loaders follow the plan for the engine's life.

With ``plan`` set (a plan file, or ``latest``: the plan the pipeline last published to the
store), or the fleet's memory on (``fleet_memory.enabled`` and ``agent.fleet_warmup``), the
worker role starts one :class:`store.serving.agent.NodeAgent` per loader it serves from
(each tenant's, plain and chat-keyed), all on one thread (:class:`store.serving.agent.AgentThread`).
At start each warms its loader from the latest plan and the fleet's memory; then each polls
the plan's version every ``agent.poll_s`` and applies a new plan when one is published:
new priorities, new copies, superseded copies cancelled. No restart is needed to take a plan.
The published plan names blocks by key (:mod:`store.published_plan`); a plan that cannot be
used counts ``agent_plan_errors`` (the agent keeps its last good plan), and entries keyed
under another root than a loader's count ``agent_plan_entries_skipped``. Each ranking also
orders the write-back's upload backlog (:meth:`store.engines.vllm.uploads.Uploads.set_ranking`):
the blocks the plan and the fleet value most go to S3 first. While the machine's node process
answers, the loaders hand their copies from S3 to it (``prefetch_handed_to_node``; the ranking, the
pool's priorities and the mapping ahead stay here), and copy alone (``prefetch_copied_blocks``)
only while it is away.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from store.engines.vllm.settings import LATEST, ConnectorSettings
from store.identity.tenant import PUBLIC
from store.serving.agent import AgentSettings, AgentThread, FilePlan, NodeAgent, PlanSource, StorePlans
from store.serving.loader_node import LoaderNode
from store.serving.upload_rank import upload_ranks
from store.tiers.registry import tiers_from_url

if TYPE_CHECKING:
    from store.engines.vllm.worker import WorkerRole
    from store.serving.prefetch import PrefetchResult
    from store.serving.urgency import Warmup

log = logging.getLogger("kvwarm.connector")


def plan_source(settings: ConnectorSettings) -> PlanSource | None:
    """Where the engine's plans come from: the store's latest, a plan file, or nowhere."""
    if settings.plan == LATEST:
        tiers = tiers_from_url(settings.store_url, settings.config.store)
        for t in tiers:  # built now, not on the agent's thread beside the first request's load
            if t.remote:
                try:
                    t.open_client()
                except Exception as exc:  # noqa: BLE001 - built on first use instead
                    log.warning("kvwarm: the plan source's S3 client could not be built now (%s)", exc)
        return StorePlans(tiers)
    if settings.plan:
        return FilePlan(settings.plan)
    return None


def start_agents(worker: "WorkerRole", settings: ConnectorSettings,
                 tokenize: Callable[[str, bool], Sequence[int]] | None) -> AgentThread | None:
    """Start the worker's agents (see the module docstring); ``None`` when there is nothing to follow.

    Never raises: a tenant whose loader cannot be made (a secret missing from the environment)
    is logged and left out; the engine serves without its agent rather than not at all.
    """
    cfg = settings.config
    fleet = cfg.agent.fleet_warmup and cfg.fleet_memory.enabled
    source = plan_source(settings)
    if source is None and not fleet:
        return None
    agent_settings = AgentSettings.of(cfg)
    counters = worker.counters
    agents: list[NodeAgent[Any]] = []
    chats = (False, True) if worker.identities[1] is not None else (False,)
    tenants = [worker.tenants.default] + sorted(t for t in worker.tenants.known if t not in (PUBLIC,
                                                                                             worker.tenants.default))
    for tenant in tenants:
        if tenant == PUBLIC:
            continue
        for chat in chats:
            try:
                loader = worker.loader(tenant, chat)
            except Exception:  # noqa: BLE001 - that tenant goes without its agent
                log.exception("kvwarm: no agent for tenant %r (its loader could not be made)", tenant)
                continue
            encode = (lambda text, chat=chat: tokenize(text, chat)) if tokenize is not None else None
            node = LoaderNode(loader, chat=chat, public=tenant == worker.tenants.default, tokenizer=encode,
                              on_result=lambda r: _prefetched(counters, r),
                              on_skipped=lambda n: counters.add("agent_plan_entries_skipped", n))
            ranked = f"agent:{tenant}:{'chat' if chat else 'plain'}"
            agents.append(NodeAgent(node, source, agent_settings,
                                    listener=lambda w, ranked=ranked: _applied(counters, w, worker, ranked),
                                    on_plan_error=lambda _: counters.add("agent_plan_errors")))
    if not agents:
        return None
    log.info("kvwarm: %d node agent(s) follow %s%s", len(agents),
             "the store's latest plan" if settings.plan == LATEST else (settings.plan or "no plan"),
             " and the fleet's memory" if fleet else "")
    return AgentThread(agents).start()


def _prefetched(counters: Any, result: "PrefetchResult") -> None:
    counters.add("prefetched_blocks", result.mapped)
    counters.add("prefetch_copied_blocks", result.fetched)
    counters.add("prefetch_handed_to_node", result.handed)
    if result.superseded:
        counters.add("prefetch_superseded", result.superseded)


def _applied(counters: Any, warm: "Warmup[Any]", worker: "WorkerRole", source: str) -> None:
    counters.add("agent_rankings")
    counters.add("agent_copies_queued", len(warm.order))
    uploads = worker.writer.uploads if worker.writer is not None else None
    if uploads is not None:  # the write-back's upload backlog drains the blocks this ranking values first
        uploads.set_ranking(source, upload_ranks(warm.wanted))
