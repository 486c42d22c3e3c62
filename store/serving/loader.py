"""The serving-side loader: longest stored prefix, mapped from the node's shared pool, handed to engines.

What a serving process imports (store + torch; transformers only inside :meth:`LoaderHit.to_dynamic_cache`)::

    loader = KVLoader("file:///var/cache/kvwarm,s3://kvwarm-kv/prod", tenant="acme",
                      model="/models/llama-3-8b", pool_bytes=16 << 30)
    hit = loader.lookup(prompt_ids)            # None on any miss; never raises for store trouble
    if hit is not None:
        with hit:                              # pins the snapshots until released
            cache = hit.to_dynamic_cache("cuda", torch.bfloat16)
        out = model.generate(input_ids, cache=cache, ...)

The request never fails because of kvwarm: S3 down, a corrupt, expired or mismatched snapshot, another
tenant's namespace, a full pool, a full disk, a process over ``max_shared_instances``: each is a miss (or a
hit cut short) with a reason, or a hit served all the same, counted in :attr:`KVLoader.metrics` and logged.
See docs/guides/loader.md.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from store.config import KvwarmConfig, load_config
from store.errors import StoreRecordInvalid, StoreUnavailable, TenantAccessDenied
from store.identity.fingerprint import ModelIdentity, identity_from_dir
from store.identity.keys import Block, KeyRoot, block_chain
from store.identity.tenant import PUBLIC, PUBLIC_TENANT, Tenant
from store.kernels.dequant import Dequantizer, DequantMode
from store.miss import MissReason, reason_of
from store.node.client import NodeClient
from store.plan import Plan
from store.serving.fetch import ERRORS, RemoteFetcher, Scope
from store.serving.fleet import FleetRecorder, Use, read_fleet
from store.serving.hit import LoaderHit
from store.serving.mapper import PoolMapper
from store.serving.metrics import LoaderMetrics, loader_stats
from store.serving.node_link import NodeLink
from store.serving.pool import PoolAttachRefused, SnapshotPool, default_pool_dir, readahead
from store.serving.prefetch import Prefetcher, PrefetchResult, plan_chains
from store.serving.remote import open_clients, warm_up
from store.tiers.base import object_name
from store.tiers.registry import tiers_from_url
from store.tiers.store import Store

log = logging.getLogger("kvwarm.loader")
FetchMode = Literal["background", "sync"]


class KVLoader:
    """Serving-side access to a kvwarm store for one tenant and one model.

    Args:
        store_url: tiers, e.g. ``file:///var/cache/kvwarm`` or ``file:///...,s3://bucket/prefix``.
        tenant: a :class:`store.identity.tenant.Tenant`, or a name resolved through the config.
        model: a :class:`store.identity.fingerprint.ModelIdentity`, or a saved model directory
            (fingerprinted from its files; its ``config.json`` then serves
            :meth:`LoaderHit.to_dynamic_cache`).
        pool_bytes: the most snapshot bytes this node keeps mapped (the node-wide budget
            is the smallest any attached process asks for).

        Keywords left as ``None`` (``pool_bytes``, ``fetch_mode``, ``sync_fetch_timeout_s``,
        ``s3_backoff_s``, ``pool_dir``, ``verify_payload``, ``fetch_workers``, ``prefetch_streams``,
        ``dequant``)
        take the config's ``loader`` section (docs/reference/config.md).
        config: a :class:`KvwarmConfig` or a config file path (default ``load_config()``);
            precision, block size, TTL and ``max_shared_instances`` come from it.
        chat: with a model directory: the prompts went through its chat template (its
            hash is part of the keys, as in the prefill job).
        model_config: the model's transformers config (optional; see ``to_dynamic_cache``).
        fetch_mode: ``background`` (default): an NVMe miss answers now and S3 is asked for
            next time; ``sync``: wait up to ``sync_fetch_timeout_s`` for S3.
        sync_fetch_timeout_s: the most a lookup waits for S3 in ``sync`` mode.
        s3_backoff_s: after S3 fails, do not ask it again for this long.
        pool_dir: where the node pool's state lives (default under ``/dev/shm``).
        verify_payload: check payload checksums when a snapshot first enters the pool
            (reads it once per node); ``False`` reads nothing but headers until used.
        registry: Prometheus registry (default: one of the loader's own).
        fetch_workers: background fetch threads (a lookup's NVMe miss copied for next time).
        prefetch_streams: chains :meth:`prefetch` copies from S3 at once, on threads of their
            own (so that a long prefetch leaves ``fetch_workers`` to the lookups' fetches).
        dequant: CPU FP8 dequantiser: ``table`` (default: per-head tables, no warm-up; the
            fastest where the native gather ``store.kernels._fp8gather`` was built, see
            :func:`store.kernels.table.native_isa`), ``compiled`` (a torch.compile kernel built on
            first use of a block shape: seconds of compiling), or ``auto`` (the native table
            where it is built, otherwise the numpy table until the kernel is built in the
            background); or a :class:`store.kernels.dequant.Dequantizer` shared by several loaders.
        node_id: this node's name in the fleet's records (default: ``$KVWARM_NODE_ID``, the config's
            ``fleet_memory.node_id``, the host name); with ``fleet_memory.enabled``, :meth:`record_use`
            records what this node serves (docs/reference/fleet.md).
        fleet: a recorder shared by the process's loaders (one per tenant and chat keying: they must
            share one, or their files of a namespace overwrite each other); its owner closes it.
        node: the machine's node process (docs/guides/node.md): a connected ``NodeClient``, or ``"auto"``
            for the one at ``node.socket`` when it answers now (none is started). Lookups, copies from S3 and
            fleet records then go through it; each call works alone when it is away. Default: alone.
        clock: time source (TTL, LRU).
    """

    def __init__(self, store_url: str, *, tenant: Tenant | str, model: ModelIdentity | str | os.PathLike[str],
                 pool_bytes: int | None = None, config: KvwarmConfig | str | os.PathLike[str] | None = None,
                 chat: bool = False, model_config: Any = None, fetch_mode: FetchMode | None = None,
                 sync_fetch_timeout_s: float | None = None, s3_backoff_s: float | None = None,
                 pool_dir: str | os.PathLike[str] | None = None,
                 verify_payload: bool | None = None, registry: CollectorRegistry | None = None,
                 fetch_workers: int | None = None, prefetch_streams: int | None = None,
                 dequant: DequantMode | Dequantizer | None = None, node_id: str | None = None,
                 fleet: FleetRecorder | None = None, node: NodeClient | Literal["auto"] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config if isinstance(config, KvwarmConfig) else load_config(config)
        # keywords left as None take the config's loader section; the rest are checked as it is
        d = self.config.loader.with_overrides(
            pool_bytes=pool_bytes, fetch_mode=fetch_mode, sync_fetch_timeout_s=sync_fetch_timeout_s,
            s3_backoff_s=s3_backoff_s, pool_dir=pool_dir, verify_payload=verify_payload, fetch_workers=fetch_workers,
            prefetch_streams=prefetch_streams, dequant=None if isinstance(dequant, Dequantizer) else dequant)
        self.tenant = tenant if isinstance(tenant, Tenant) else self.config.tenant(tenant)
        self._model_dir: Path | None = None
        if isinstance(model, ModelIdentity):
            self.identity = model
        else:
            self._model_dir = Path(model)
            self.identity = identity_from_dir(self._model_dir, chat=chat)
        self._model_config = model_config
        self.precision = self.config.kv_cache.precision()
        if isinstance(getattr(model_config, "num_hidden_layers", None), int):  # the model is known: its layers too
            self.precision.check_layers(model_config.num_hidden_layers, model="the loader's model_config")
        self.root: KeyRoot = self.identity.key_root(self.precision, self.config.kv_cache.block_size, self.tenant.salt)
        self._own = Scope(self.root, self.tenant.name)
        # prefixes prefilled on purpose for everyone (a shared system prompt) live under
        # the public salt: a lookup also tries them and keeps the longer hit
        self._public: Scope | None = None
        if d.public_prefixes and self.tenant.name != PUBLIC:
            self._public = Scope(self.identity.key_root(self.precision, self.config.kv_cache.block_size,
                                                         PUBLIC_TENANT.salt), PUBLIC)
        self.fetch_mode: FetchMode = d.fetch_mode
        self.verify_payload = d.verify_payload
        self.clock = clock

        tiers = tiers_from_url(store_url, self.config.store)
        if not tiers[0].mappable:
            raise ValueError(f"the loader needs a tier it can map first (file://), got {tiers[0].url!r}: "
                             "snapshots are mapped from it")
        open_clients(tiers)  # before the loader serves (store/serving/remote.py)
        # One store: the hot path asks only its local tiers (never the network), fetches all of them.
        self.store = Store(tiers, clock=clock)
        self.local = tiers[0]
        self.metrics = LoaderMetrics(registry, tenant=self.tenant.name, store=self.store.stats)
        fm = self.config.fleet_memory
        self._own_fleet = fleet is None and fm.enabled
        self.fleet = FleetRecorder.from_config(tiers, fm, node_id=node_id, clock=clock) if self._own_fleet else fleet
        self.pool = SnapshotPool(d.pool_dir or default_pool_dir(self.local.url), budget_bytes=int(d.pool_bytes),
                                 max_instances=self.config.kv_cache.max_shared_instances, clock=clock)
        self._attach_next = 0.0
        self._try_attach()
        self.mapper = PoolMapper(self.store, self.tenant, self.pool, self.metrics, verify_payload=self.verify_payload,
                                 clock=clock)
        self._executor = cf.ThreadPoolExecutor(max_workers=d.fetch_workers, thread_name_prefix="kvwarm-fetch")
        self.fetcher = RemoteFetcher(self.store, self.tenant, self.metrics, self._executor,
                                     timeout_s=d.sync_fetch_timeout_s, backoff_s=d.s3_backoff_s,
                                     gets=d.chain_gets, get_threads=d.chain_gets * (d.fetch_workers + 1))
        self.node = NodeLink.open(node, self.config, store_url)  # it copies, a prefetch's chains too, when it answers
        self.prefetcher = Prefetcher(d.prefetch_streams, probe=self._probe_local, fetcher=self.fetcher,
                                     metrics=self.metrics, node=self.node)
        self.dequantizer = dequant if isinstance(dequant, Dequantizer) else Dequantizer(
            d.dequant, self._executor, staging_bytes=int(d.staging_bytes), scratch_bytes=int(d.device_scratch_bytes))
        self._closed = False
        if self.fetcher.has_remote and self.fetch_mode == "sync":  # a sync lookup waits for S3: connect first
            public = [PUBLIC] if self._public is not None else []
            self._executor.submit(warm_up, self.store, self.tenant, [self.tenant.name, *public])

    def _try_attach(self) -> bool:
        if self.pool.attached:
            return True
        now = time.monotonic()
        if now < self._attach_next:
            return False
        try:
            self.pool.attach()
            return True
        except PoolAttachRefused as exc:
            self._attach_next = now + 5.0
            log.warning("%s; lookups miss until a slot frees", exc)
            return False

    @property
    def sync_fetch_timeout_s(self) -> float:
        """The most a ``sync`` lookup waits for S3."""
        return self.fetcher.timeout_s

    @property
    def s3_backoff_s(self) -> float:
        """How long S3 is not asked again after it failed."""
        return self.fetcher.backoff_s

    def model_config(self) -> Any:
        """The model's transformers config: as given, else read from the model directory (lazily)."""
        if self._model_config is None and self._model_dir is not None:
            from transformers import AutoConfig

            self._model_config = AutoConfig.from_pretrained(self._model_dir)
        return self._model_config

    # -- lookup --------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> LoaderHit | None:
        """The longest stored exact prefix of ``token_ids`` (whole blocks), or ``None``.

        Never raises for store trouble: every failure is a counted, logged miss (or a hit
        cut short before the failing block). Bad arguments (not a flat sequence of token
        ids) raise ``ValueError``.
        """
        return self.lookup_with_reason(token_ids)[0]

    def lookup_with_reason(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor
                           ) -> tuple[LoaderHit | None, str | None]:
        """:meth:`lookup`, and why the hit is missing or shorter than the stored chain (a
        :data:`store.serving.metrics.MISS_REASONS` value; ``None`` for a full hit). An engine
        that was promised the whole chain reports that reason for the part it did not get."""
        t0 = time.perf_counter()
        ids = token_ids.detach().cpu().numpy() if isinstance(token_ids, torch.Tensor) else np.asarray(token_ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        blocks = block_chain(self.root, ids)  # ValueError for bad input: a programming error
        self.metrics.lookup()
        try:
            hit, reason = self._lookup(self._own, blocks, len(ids))
            if self._public is not None and (hit is None or len(hit.blocks) < len(blocks)):
                hit, reason = self._longer_public(hit, reason, ids)
        except (TenantAccessDenied, StoreUnavailable, StoreRecordInvalid) as exc:  # counted by the store
            hit, reason = None, reason_of(exc)  # a bad record is logged once, by the store
            (log.debug if isinstance(exc, StoreRecordInvalid) else log.warning)("lookup: %s", exc)
        except ERRORS as exc:
            hit, reason = None, MissReason.ERROR
            log.exception("lookup failed, served as a miss: %s", exc)
        if hit is None:
            reason = reason or MissReason.ABSENT
            self.metrics.miss(reason)
            log.debug("miss (%s) for a %d-token prompt", reason, len(ids))
        else:
            self.metrics.hit(hit.tokens)
            if reason:
                self.metrics.shortened(reason)
        self.metrics.observe("lookup", time.perf_counter() - t0)
        return hit, reason

    def _longer_public(self, hit: LoaderHit | None, reason: MissReason | None,
                       ids: np.ndarray) -> tuple[LoaderHit | None, MissReason | None]:
        """The public namespace's hit for ``ids`` if it is longer than the tenant's own ``hit``."""
        assert self._public is not None
        have = len(hit.blocks) if hit is not None else 0
        bs = self._public.root.block_size
        head = block_chain(self._public.root, ids[: (have + 1) * bs])  # only what the first probe needs
        if len(head) <= have or self._probe_local(head, self._public) <= have:
            return hit, reason  # nothing longer stored locally under public (the common case: one probe)
        phit, preason = self._lookup(self._public, block_chain(self._public.root, ids), len(ids))
        if phit is None or len(phit.blocks) <= have:
            if phit is not None:
                phit.release()
            return hit, reason
        if hit is not None:
            hit.release()
        return phit, preason

    def _lookup(self, scope: Scope, blocks: list[Block],
                n_tokens: int) -> tuple[LoaderHit | None, MissReason | None]:
        if not blocks or n_tokens < 2:
            return None, MissReason.SHORT_PROMPT
        if not self._try_attach():
            return None, MissReason.MAX_SHARED_INSTANCES
        self.mapper.reconcile()
        count = self._probe_local(blocks, scope)
        reason: MissReason | None = None
        tier = self.local.kind
        if count < len(blocks) and self.fetcher.has_remote:
            if not self.fetcher.usable():
                reason = MissReason.STORE_UNAVAILABLE
            elif self.fetch_mode == "sync":
                got, reason = self.fetcher.fetch_sync(scope, blocks, count)
                if got > count:
                    count, tier = got, self.fetcher.remote_kind
            else:
                self.node.fetch(scope, blocks[count:], self.fetcher.schedule)
                reason = MissReason.FETCH_SCHEDULED
        if count == 0:
            return None, reason or MissReason.ABSENT
        hit, stop = self._map_and_pin(blocks[:count], n_tokens, tier, scope)
        return hit, stop or (reason if hit is None else None)

    def _map_and_pin(self, blocks: Sequence[Block], n_tokens: int, tier: str,
                     scope: Scope) -> tuple[LoaderHit | None, MissReason | None]:
        pinned = self.mapper.map_and_pin(blocks, scope)
        if not pinned.snapshots:
            return None, pinned.stop
        n = len(pinned.snapshots)
        hit = LoaderHit(self, blocks[:n], pinned.snapshots, pinned.names, pinned.admissions, n_tokens,
                        "pool" if pinned.all_pooled and tier == self.local.kind else tier)
        return hit, pinned.stop

    # -- prefetch ------------------------------------------------------------
    def prefetch(self, items: Plan | str | os.PathLike[str] | Iterable[Sequence[int]], *, map_ahead: bool = True,
                 tokenizer: Callable[[str], Sequence[int]] | None = None) -> "cf.Future[PrefetchResult]":
        """In the background: copy prefixes S3 -> NVMe (the node does, when linked) and (``map_ahead``) map them.

        ``prefetch_streams`` chains are copied at once, taken in priority order (the first
        entries start first), each block by block in prefix order; a head that several
        chains share is copied once.

        Args:
            items: a :class:`store.plan.Plan` (or a plan file): its entries for this tenant
                and for ``public`` (unless public prefixes are off), in priority order; their
                ``score`` becomes the pool's retention priority of their blocks, in place of the
                last plan's. Or prefixes as token-id sequences (no priority).
            map_ahead: also map and admit them into the node's pool (and read them ahead
                into the page cache), so the first lookup pays nothing.
            tokenizer: turns a plan entry's ``text`` into token ids (entries with text are
                skipped without one).

        Returns:
            A future of a :class:`PrefetchResult`; it never raises for store trouble.
        """
        scopes = {self.tenant.name: self._own, **({PUBLIC: self._public} if self._public else {})}
        chains, skipped = plan_chains(items, self._own, scopes, tokenizer)
        if isinstance(items, (Plan, str, os.PathLike)):
            self.mapper.prioritise(chains)  # the latest plan's scores replace the last plan's
        return self.prefetcher.run(chains, skipped, map_ahead=self._map_ahead if map_ahead else None)

    def _probe_local(self, chain: list[Block], scope: Scope) -> int:
        """Leading blocks of ``chain`` in the local tiers (no network): the node's answer where one runs."""
        return self.node.probe(scope, chain, lambda: self.store.probe(self.tenant, chain, scope.root,
                                                                      local_only=True).count)

    def _map_ahead(self, chain: list[Block], scope: Scope) -> int:
        """Read ``chain``'s files ahead, map and admit them (pinned only for this call)."""
        if not self._try_attach():
            return 0
        self.mapper.reconcile()  # so that the first lookup after a prefetch finds the mappings current
        for name in scope.names(chain):
            readahead(self.local.path(name))
        hit, _ = self._map_and_pin(chain, len(chain) * self.root.block_size + 1, self.local.kind, scope)
        if hit is None:
            return 0
        mapped = len(hit.snapshots)
        hit.release()
        return mapped

    # -- fleet memory --------------------------------------------------------
    def record_use(self, blocks: Sequence[Block] | Sequence[str], scope: Scope | None = None) -> None:
        """Record that one served request used ``blocks``, its full-block chain (fleet memory).

        ``blocks`` are keyed under ``scope`` (default: the tenant's own), or are their tier object
        names. In memory; the record is written every ``fleet_memory.flush_s`` on a background
        thread. A no-op with ``fleet_memory.enabled`` off. Raises ``ValueError`` for a bad name.
        """
        if self.fleet is None or self._closed:
            return
        scope = scope or self._own
        if self.node.record(scope, blocks):
            return
        self.fleet.record([b if isinstance(b, str) else object_name(scope.ns, b.key) for b in blocks])
        self.fleet.flush_when_due(self._executor)

    def fleet_uses(self, since: float) -> list[Use]:
        """What every node recorded since ``since`` (unix s) of the tenant's namespace and
        ``public``: :func:`store.serving.fleet.read_fleet`, newest first; never raises for store trouble."""
        namespaces = [self.tenant.name] + ([PUBLIC] if self._public is not None else [])
        return read_fleet(self.store.tiers, namespaces, since=since, stats=self.fleet.stats if self.fleet else None,
                          max_file_bytes=self.config.fleet_memory.max_file_bytes)

    # -- reporting and shutdown ----------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The loader's figures as a dict (the same as its Prometheus metrics, plus pool state)."""
        return loader_stats(self)

    def close(self) -> None:
        """Stop background work, release the pool attachment and the store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        # the prefetch streams stop after the block each is copying, and are joined: none
        # writes to the store once it is closed; their futures resolve with what was done
        self.node.close()
        self.prefetcher.close()
        self.fetcher.close()  # a lookup's fetch lands nothing more (its GETs in flight are discarded)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.fleet is not None and self._own_fleet:
            self.fleet.close()  # best effort: what this node served since the last flush
        self.mapper.clear()
        self.pool.close()
        self.store.close()

    def __enter__(self) -> "KVLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
