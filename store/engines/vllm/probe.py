"""The scheduler's probe: how many leading blocks of a prompt the node's NVMe tier holds for a tenant.

A prompt may be stored under several chains, and the KV is the same for all of them, so each
is tried and the longest kept: the tenant's own chain keyed plain and, when the model has a
chat template, keyed with its hash (``prefill warm --chat`` stores those; KV depends only on
the tokens), then the same two under ``public`` (when ``loader.public_prefixes`` is on).

Existence only: no mapping, no pin, no header read (vLLM asks again at every step a request
waits). The worker's load checks every snapshot it maps; what fails there is recomputed. Never
raises for store trouble: a failure is a hit of 0 blocks with its reason.

With the machine's node process (``node``: a :class:`store.node.client.NodeClient`), each chain's
existence is one local round trip to it (keys out, a count back: no SQLite, no file I/O on vLLM's
thread); while the node is away (killed, restarting) the probe asks the NVMe tier itself, as it
does without one, and the client reconnects on its own thread.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from store.engines.vllm.tenancy import TenantBook
from store.errors import NodeRefused, NodeUnavailable, StoreError, TenantAccessDenied
from store.format.precision import Precision
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import Block, KeyRoot, block_chain
from store.identity.tenant import PUBLIC, Tenant
from store.node.client import NodeClient
from store.serving.fetch import Scope
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")
_ERRORS = (StoreError, OSError, sqlite3.Error, ValueError)


@dataclass(frozen=True)
class ProbeHit:
    """The longest local hit of one prompt for one tenant.

    Attributes:
        blocks: leading kvwarm blocks the NVMe tier holds (0 for a miss).
        full_blocks: full kvwarm blocks in the prompt.
        namespace: where the hit is (the tenant or ``public``).
        chat: whether it is the chat-keyed chain.
        reason: why nothing (``absent``, ``short_prompt``, ``tenant_refused``, ``error``), else ``None``.
    """

    blocks: int
    full_blocks: int
    namespace: str
    chat: bool = False
    reason: str | None = None


class StoreProbe:
    """Probes of the local tier across a tenant's chains.

    Args:
        local: a store over the NVMe tier only (the scheduler never waits on the network).
        identities: the model's identity for plain prompts, and for chat-templated ones (or ``None``).
        precision: the storage precision (part of every key).
        block_size: kvwarm's block size.
        tenants: the tenants this engine serves.
        public_prefixes: also try ``public``'s chains.
        node: the machine's node process, asked first (see the module).
    """

    def __init__(self, local: Store, identities: tuple[ModelIdentity, ModelIdentity | None], precision: Precision,
                 block_size: int, tenants: TenantBook, *, public_prefixes: bool = True,
                 node: NodeClient | None = None) -> None:
        self.local = local
        self.identities = identities
        self.precision = precision
        self.block_size = block_size
        self.tenants = tenants
        self.public_prefixes = public_prefixes
        self.node = node
        self.node_fallbacks = 0  # probes the NVMe tier answered because the node was away
        self._lock = threading.Lock()
        self._roots: dict[tuple[str, bool], KeyRoot] = {}

    def root(self, namespace: str, chat: bool) -> KeyRoot:
        """The key root of ``namespace``'s chains, plain or chat-keyed (cached)."""
        with self._lock:
            root = self._roots.get((namespace, chat))
        if root is None:
            identity = self.identities[1] if chat else self.identities[0]
            if identity is None:
                raise ValueError("this model has no chat template: there is no chat-keyed chain")
            root = identity.key_root(self.precision, self.block_size, self.tenants.credentials(namespace).salt)
            with self._lock:
                self._roots[(namespace, chat)] = root
        return root

    def scope(self, namespace: str, chat: bool) -> Scope:
        """Where ``namespace``'s plain or chat-keyed chains live (for fetches)."""
        return Scope(self.root(namespace, chat), namespace)

    def chain(self, namespace: str, chat: bool, token_ids: Sequence[int] | np.ndarray) -> list[Block]:
        """The blocks of ``token_ids`` keyed under ``namespace``'s plain or chat-keyed root."""
        return block_chain(self.root(namespace, chat), token_ids)

    def _scopes(self, tenant: str) -> list[tuple[str, bool]]:
        chats = (False, True) if self.identities[1] is not None else (False,)
        spaces = [tenant] + ([PUBLIC] if self.public_prefixes and tenant != PUBLIC else [])
        return [(ns, chat) for ns in spaces for chat in chats]

    def probe(self, tenant: str, token_ids: Sequence[int] | np.ndarray) -> ProbeHit:
        """The longest hit of ``token_ids`` among ``tenant``'s chains (see the module)."""
        full = len(token_ids) // self.block_size
        if full == 0 or len(token_ids) < 2:
            return ProbeHit(0, full, tenant, reason="short_prompt")
        best = ProbeHit(0, full, tenant, reason="absent")
        for ns, chat in self._scopes(tenant):
            try:
                caller = self.tenants.credentials(tenant)
                root = self.root(ns, chat)
                blocks = block_chain(root, token_ids)
                n = self._held(caller, ns, blocks, root)
            except TenantAccessDenied as exc:
                log.warning("probe refused: %s", exc)
                if best.blocks == 0:
                    best = ProbeHit(0, full, ns, chat, reason="tenant_refused")
                continue
            except _ERRORS as exc:
                log.warning("probe failed, served as a miss: %s", exc)
                if best.blocks == 0 and best.reason != "tenant_refused":
                    best = ProbeHit(0, full, ns, chat, reason="error")
                continue
            if n > best.blocks:
                best = ProbeHit(n, full, ns, chat)
            if best.blocks == full:
                break
        return best

    def _held(self, caller: Tenant, ns: str, blocks: list[Block], root: KeyRoot) -> int:
        """Leading ``blocks`` of ``ns``'s chain the NVMe tier holds: the node's answer, else the tier's."""
        if self.node is not None:
            try:
                return self.node.lookup(ns, [b.key for b in blocks]).count
            except (NodeUnavailable, NodeRefused) as exc:
                self.node_fallbacks += 1
                log.debug("the kvwarm node is away (%s): probing the NVMe tier", exc)
        return self.local.probe(caller, blocks, root).count

    def held_by_others(self, tenant: str, token_ids: Sequence[int] | np.ndarray) -> list[str]:
        """The other tenants of this engine whose chains hold the prompt's first block.

        Their prefix is what this request would have used had the tenants not been kept apart:
        the connector counts it as a refused cross-tenant access. Every other tenant is probed
        (one block each, both chains), whatever the first answer: the work does not depend on
        who holds it (:mod:`store.engines.vllm.audit` runs it off the request path).
        """
        head = np.asarray(token_ids)[: self.block_size]
        if len(head) < self.block_size:
            return []
        holders = []
        for other in self.tenants.others(tenant):
            held = False
            for chat in (False, True) if self.identities[1] is not None else (False,):
                try:
                    root = self.root(other, chat)
                    held |= self.local.probe(self.tenants.credentials(other), block_chain(root, head), root).count > 0
                except _ERRORS as exc:  # an unreadable namespace, a secret not set: not ours to report
                    log.debug("cross-tenant check of %r skipped: %s", other, exc)
            if held:
                holders.append(other)
        return holders
