"""The node agent's hands on a real node: one :class:`store.serving.loader.KVLoader`.

:class:`LoaderNode` is what :class:`store.serving.agent.NodeAgent` drives on a serving node
(the vLLM connector makes one per loader; :func:`start_agent` for loader users):

- a plan's entries become the loader's block chains (this tenant's, and ``public``'s where
  this loader serves them), named as the tiers name them (``<namespace>/<key>``): a published
  plan (:mod:`store.published_plan`) names them by key already, and its entries whose key
  root differs from this loader's (another model, precision or salt) are skipped and counted
  (``root_skipped``); a plan file's prompts are keyed here, as a lookup keys them;
- the fleet's memory is read for the loader's namespaces only (:func:`store.serving.fleet.read_fleet`);
- retention priorities go to the loader's pool (its eviction order: lowest first, then LRU);
- copies go to the loader's prefetch streams, replacing the last prefetch: a plan's chains
  are copied block by block in prefix order (by the machine's node process while the loader is
  linked to one, :mod:`store.serving.prefetch`) and mapped into the pool ahead of need (those
  NVMe already holds are mapped after the copies; a published chain's tokens are read from
  its snapshot headers in NVMe, checked against its keys); blocks known only from the fleet's
  memory are copied by key into NVMe (their tokens are checked by the lookup that maps them).
"""
from __future__ import annotations

import logging
import os
import sqlite3
from typing import TYPE_CHECKING, Any, Callable, Sequence

from store.format.snapshot import read_header
from store.identity.keys import Block, BlockKey, root_key
from store.identity.tenant import PUBLIC
from store.plan import Plan
from store.published_plan import PublishedPlan, root_id
from store.serving.fetch import ERRORS, Scope
from store.serving.prefetch import PrefixChain, plan_prefixes
from store.serving.urgency import PlanChain, UseLike
from store.tiers.base import parse_object_name

if TYPE_CHECKING:
    from store.serving.agent import AgentThread
    from store.serving.loader import KVLoader
    from store.serving.prefetch import PrefetchResult

log = logging.getLogger("kvwarm.agent")


class HeldNames:
    """The NVMe tier as a container of object names (asked name by name, as the ranking needs)."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier

    def __contains__(self, name: object) -> bool:
        try:
            return isinstance(name, str) and self.tier.exists(name)
        except OSError:
            return False


class LoaderNode:
    """A :class:`KVLoader` as a node the agent drives.

    Args:
        loader: the node's loader.
        chat: take the plan's chat entries (a chat-keyed loader) rather than its plain ones.
        public: also take ``public``'s entries (one loader per engine should: the default
            tenant's).
        tokenizer: turns an entry's ``text`` into token ids (entries with text are skipped without).
        link_bytes_per_s: the node's read rate from S3 (the config's ``agent.link_bytes_per_s``).
        node_id: this node's name in the fleet's memory (default the loader's).
        on_result: told each prefetch's result when it ends (superseded ones too).
        on_skipped: told how many entries of each published plan were skipped for their key root.
    """

    def __init__(self, loader: "KVLoader", *, chat: bool = False, public: bool = True,
                 tokenizer: Callable[[str], Sequence[int]] | None = None, link_bytes_per_s: float | None = None,
                 node_id: str | None = None, on_result: Callable[["PrefetchResult"], None] | None = None,
                 on_skipped: Callable[[int], None] | None = None) -> None:
        self.loader = loader
        self.chat = chat
        self.tokenizer = tokenizer
        self.scopes: dict[str, Scope] = {loader.tenant.name: loader._own}
        if public and loader._public is not None:
            self.scopes[PUBLIC] = loader._public
        self.link = float(link_bytes_per_s or loader.config.agent.link_bytes_per_s)
        if node_id is None:
            from store.serving.fleet import resolve_node_id

            node_id = loader.fleet.node_id if loader.fleet is not None else resolve_node_id(
                None, loader.config.fleet_memory.node_id)
        self.node_id = node_id
        self._refs: dict[str, tuple[list[Block] | list[BlockKey], int, Scope]] = {}
        # the last plan's chains, in its order (a published plan's: keys, their tokens in the headers)
        self._plan: list[tuple[list[Block] | list[BlockKey], Scope]] = []
        self.root_skipped = 0  # published entries skipped: keyed under another root than this loader's
        self.on_result = on_result
        self.on_skipped = on_skipped

    # -- what the agent reads --------------------------------------------------
    def plan_chains(self, plan: Plan | PublishedPlan) -> list[PlanChain[str]]:
        found: list[tuple[float, float, list[Block] | list[BlockKey], Scope]]
        if isinstance(plan, PublishedPlan):
            found = self._published(plan)
        else:
            entries = [e for e in plan.entries if e.chat == self.chat]
            pairs, _ = plan_prefixes(Plan(entries=tuple(entries)), self.scopes, self.tokenizer)
            found = [(float(e.expected_hits), float(e.score), chain, scope) for e, chain, scope in pairs]
        refs: dict[str, tuple[list[Block] | list[BlockKey], int, Scope]] = {}
        out = []
        for hits, score, chain, scope in found:
            if not chain:
                continue
            names = scope.names(chain)
            for i, name in enumerate(names):
                refs.setdefault(name, (chain, i, scope))
            out.append(PlanChain(tuple(names), hits, score))
        self._refs = refs
        self._plan = [(chain, scope) for _, _, chain, scope in found if chain]
        return out

    def _published(self, plan: PublishedPlan) -> list[tuple[float, float, list[BlockKey], Scope]]:
        """A published plan's entries for this loader (its namespaces, plain or chat-keyed, its key root)."""
        roots = {ns: root_id(scope.root) for ns, scope in self.scopes.items()}
        out, skipped = [], 0
        for e in plan.entries:
            scope = self.scopes.get(e.namespace)
            if scope is None or e.chat != self.chat:
                continue  # another tenant's, or the other loader's (chat-keyed or plain)
            if e.root != roots[e.namespace]:
                skipped += 1
                continue
            out.append((float(e.expected_hits), float(e.score), list(e.keys), scope))
        if skipped:
            self.root_skipped += skipped
            if self.on_skipped is not None:
                self.on_skipped(skipped)
            log.warning("kvwarm agent: %d entries of the published plan are keyed under another key root than this "
                        "loader's (model %s, precision or tenant secret differ from the pipeline's); skipped",
                        skipped, plan.model)
        return out

    def fleet(self, since: float, *, others_only: bool) -> Sequence[UseLike[str]]:
        from store.serving.fleet import read_fleet

        try:
            fleet = self.loader.fleet
            return read_fleet(self.loader.store.tiers, [s.ns for s in self.scopes.values()], since=since,
                              exclude_node=self.node_id if others_only else None,
                              stats=fleet.stats if fleet is not None else None,
                              max_file_bytes=self.loader.config.fleet_memory.max_file_bytes)
        except ERRORS as exc:
            log.warning("kvwarm agent: the fleet's memory could not be read (%s); warming from the plan only", exc)
            return []

    def held(self) -> HeldNames:
        return HeldNames(self.loader.local)

    def _block_bytes(self) -> float:
        """The mean stored block's size in the NVMe tier (0: nothing stored yet, size unknown)."""
        try:
            n = self.loader.local.index.count()
            return self.loader.local.usage() / n if n else 0.0
        except (AttributeError, sqlite3.Error, OSError):
            return 0.0

    def capacity(self) -> int:
        size = self._block_bytes()
        cap = getattr(self.loader.local, "cap_bytes", 0)
        return int(cap // size) if size and cap else 1 << 40

    def copy_s(self) -> float:
        return self._block_bytes() / self.link

    # -- what the agent does ---------------------------------------------------
    def retain(self, priority: dict[str, float]) -> None:
        self.loader.mapper.priority = dict(priority)

    def prefetch(self, order: list[str]) -> None:
        # the copies first; then the plan's chains NVMe holds whole, mapped into the pool ahead of need
        copying = set(order)
        chains = self.chains(order) + [(chain, None, scope) for chain, scope in self._plan
                                       if not copying.intersection(scope.names(chain))]
        fut = self.loader.prefetcher.run(chains, 0, map_ahead=self._map_ahead, replace=True)
        fut.add_done_callback(self._done)

    def _map_ahead(self, chain: list[Block] | list[BlockKey], scope: Scope) -> int:
        """Map a chain NVMe holds into the pool: a plan's blocks as the loader does; a published
        chain's keys once their tokens are read from NVMe and checked; the fleet's bare keys not
        (the lookup that needs them maps them)."""
        if chain and isinstance(chain[0], str):
            ref = self._refs.get(scope.names(chain[-1:])[0])
            if ref is None or ref[1] != len(chain) - 1 or ref[0][:len(chain)] != chain:
                return 0  # a key only the fleet's memory names
            chain = self.blocks_of(chain, scope)  # type: ignore[arg-type]
            if not chain:
                return 0
        return self.loader._map_ahead(chain, scope)  # type: ignore[arg-type]

    def blocks_of(self, keys: list[BlockKey], scope: Scope) -> list[Block]:
        """The leading blocks of chain ``keys`` (from the root of ``scope``) whose snapshot headers in
        NVMe hold tokens that hash to their keys: what a lookup of those tokens would map."""
        out: list[Block] = []
        parent = root_key(scope.root)
        for i, (key, name) in enumerate(zip(keys, scope.names(keys))):
            try:
                buf = self.loader.local.read(name)
                if buf is None:
                    break
                header = read_header(buf, location=name)
                header.check_consistent(location=name)
                header.check_identity(key, scope.root, location=name)
            except Exception as exc:  # noqa: BLE001 - mapping ahead is best effort: the lookup checks again
                log.info("kvwarm agent: block %s not mapped ahead: %s", name, exc)
                break
            if header.parent_key != parent:
                break
            out.append(Block(i, key, parent, tuple(header.token_ids)))
            parent = key
        return out

    def _done(self, fut: Any) -> None:
        try:
            r = fut.result()
        except Exception:  # noqa: BLE001 - prefetch is best effort
            log.exception("kvwarm agent: a prefetch failed")
            return
        log.info("kvwarm agent: prefetch done: %d chains, %d blocks copied, %d handed to the node, %d present, "
                 "%d mapped, %d superseded, failures %s", r.prefixes, r.fetched, r.handed, r.present, r.mapped,
                 r.superseded, r.failed or "none")
        if self.on_result is not None:
            self.on_result(r)

    def chains(self, order: Sequence[str]) -> list[PrefixChain]:
        """``order`` as the prefetcher's items: runs of one plan chain's blocks in prefix order
        become that chain up to the run's last block; a name only the fleet knows is a
        one-key item (names of namespaces this loader does not serve are left out)."""
        out: list[PrefixChain] = []
        i = 0
        while i < len(order):
            ref = self._refs.get(order[i])
            if ref is not None:
                chain, last, scope = ref
                while i + 1 < len(order):
                    nxt = self._refs.get(order[i + 1])
                    if nxt is None or nxt[0] is not chain or nxt[1] != last + 1:
                        break
                    last = nxt[1]
                    i += 1
                out.append((chain[:last + 1], None, scope))
            else:
                try:
                    ns, key = parse_object_name(order[i])
                except ValueError:
                    ns, key = "", ""
                scope = self.scopes.get(ns)
                if scope is not None:
                    keys: list[BlockKey] = [BlockKey(key)]
                    out.append((keys, None, scope))
            i += 1
        return out



def start_agent(loader: "KVLoader", plan: "str | os.PathLike[str] | None" = "latest", *,
                tokenizer: Callable[[str], Sequence[int]] | None = None, chat: bool = False) -> "AgentThread":
    """Start a node agent for ``loader`` on a thread of its own; ``close()`` it before the loader.

    Args:
        plan: ``"latest"`` (the plan the pipeline publishes to the loader's store), a plan file
            (followed as it is replaced), or ``None`` (the fleet's memory only).
        tokenizer: turns plan entries given as text into token ids.
        chat: the loader keys chat-templated prompts (its plan entries with ``chat``).

    The agent's knobs are the loader's config ``agent`` section (docs/reference/config.md).
    """
    from store.serving.agent import AgentSettings, AgentThread, FilePlan, NodeAgent, StorePlans

    source = None if plan is None else StorePlans(loader.store.tiers) if plan == "latest" else FilePlan(plan)
    node = LoaderNode(loader, chat=chat, tokenizer=tokenizer)
    return AgentThread([NodeAgent(node, source, AgentSettings.of(loader.config))]).start()
