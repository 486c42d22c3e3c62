"""A lookup's result: the snapshots of a prompt's longest stored prefix, pinned, handed to engines.

:meth:`store.serving.loader.KVLoader.lookup` makes one; :meth:`LoaderHit.to_dynamic_cache`
and :meth:`LoaderHit.copy_into_paged` turn it into KV an engine can use
(transformers only inside ``to_dynamic_cache``). See docs/guides/loader.md.
"""
from __future__ import annotations

import logging
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import torch

from store.engines.paged import check_paged, fill_paged, new_dynamic_cache, put_layer
from store.format.precision import STORAGE_DTYPES
from store.format.runs import payload_plan
from store.format.snapshot import Snapshot
from store.identity.keys import Block
from store.kernels.chunks import scatter_stored
from store.kernels.staging import stage_runs
from store.kernels.table import gather_payloads_vec
from store.serving.pool import SnapshotPool

if TYPE_CHECKING:
    from store.engines.vllm.layout import EngineLayout
    from store.serving.loader import KVLoader

log = logging.getLogger("kvwarm.loader")  # the loader's logger: a hit is part of the loader's story


def _tensors(snap: Snapshot) -> dict[str, torch.Tensor]:
    """Every part of a snapshot as a zero-copy tensor, made once per mapping (~50 us a part)."""
    cached = snap.__dict__.get("_kvwarm_tensors")
    if cached is None:
        cached = {}
        with warnings.catch_warnings():
            # The mapping is read-only by design; torch warns that it cannot write to it.
            warnings.simplefilter("ignore", UserWarning)
            for p in snap.header.parts:
                raw = torch.from_numpy(snap.array(p.name))
                cached[p.name] = raw.view(STORAGE_DTYPES[p.dtype]).view(p.shape)
        snap.__dict__["_kvwarm_tensors"] = cached
    return cached


def _unpin(pool: SnapshotPool, names: list[str]) -> None:
    try:
        pool.unpin(names)
    except Exception as exc:  # noqa: BLE001 - runs from a finalizer: must never raise
        log.warning("releasing pins failed (the pool clears a dead process's pins): %s", exc)


class LoaderHit:
    """The longest stored prefix of a prompt, mapped and pinned in the node's pool.

    Attributes:
        tokens: prompt tokens the snapshots cover (a multiple of the block size).
        prompt_tokens: length of the prompt looked up.
        usable_tokens: what the caches built from this hit cover: ``tokens``, but at most
            ``prompt_tokens - 1``, because a model must compute at least one prompt
            token to produce logits (``generate()`` silently diverges otherwise).
        tier: where the snapshots were found: ``pool`` (already mapped on this node),
            ``nvme``, or ``s3`` (fetched synchronously for this lookup).
        snapshots: one per block, in prefix order (valid until :meth:`release`).
        blocks: the blocks they hold.
        layout: their geometry (layers, kv heads, head dim, block size).
        names, admissions: the pool entries pinned for this hit (an admission id changes
            if an entry is evicted and admitted again).
    """

    def __init__(self, loader: "KVLoader", blocks: Sequence[Block], snapshots: Sequence[Snapshot], names: list[str],
                 admissions: list[int], prompt_tokens: int, tier: str) -> None:
        self._loader = loader
        self.blocks = tuple(blocks)
        self.snapshots: tuple[Snapshot, ...] = tuple(snapshots)
        self.names = tuple(names)
        self.admissions = tuple(admissions)
        self.block_size = loader.root.block_size
        self.tokens = len(self.snapshots) * self.block_size
        self.prompt_tokens = prompt_tokens
        self.usable_tokens = min(self.tokens, prompt_tokens - 1)
        self.tier = tier
        self.layout = self.snapshots[0].header.layout
        self._finalizer = weakref.finalize(self, _unpin, loader.pool, list(names))

    def __repr__(self) -> str:
        return f"LoaderHit(tokens={self.tokens}, usable_tokens={self.usable_tokens}, tier={self.tier!r})"

    # -- lifetime ------------------------------------------------------------
    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Unpin the snapshots (idempotent). Caches already built stay valid; the hit does not."""
        self.snapshots = ()
        self._finalizer()

    def __enter__(self) -> "LoaderHit":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError("this hit was released; build caches before release() (or lookup again)")

    def _parts(self, layer: int, name: str, blocks: slice = slice(None),
               heads: slice = slice(None)) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each block's stored part and its scales (per head, or per head and group): views of the
        mapping, of ``heads`` only (a part is ``[heads, tokens, dim]``, so a head range is one run)."""
        self._check_live()
        out = []
        for snap in self.snapshots[blocks]:
            parts = _tensors(snap)
            scale = parts.get(f"{name}_scale.{layer}")
            out.append((parts[f"{name}.{layer}"][heads], None if scale is None else scale[heads]))
        return out

    def _share(self, layers: Sequence[int] | None, heads: slice | None) -> tuple[tuple[int, ...], slice]:
        """``layers`` and ``heads`` of :meth:`dequantized`, checked against the snapshots' layout."""
        lay = self.layout
        chosen = tuple(range(lay.num_layers)) if layers is None else tuple(int(i) for i in layers)
        if not chosen or len(set(chosen)) != len(chosen) or any(not 0 <= i < lay.num_layers for i in chosen):
            raise ValueError(f"layers {list(chosen)} are not distinct layers of these snapshots' "
                             f"{lay.num_layers}")
        if heads is None:
            return chosen, slice(0, lay.num_kv_heads)
        start, stop, step = heads.indices(lay.num_kv_heads)
        if step != 1 or start >= stop or (heads.stop is not None and heads.stop > lay.num_kv_heads):
            raise ValueError(f"heads {heads} are not a range of these snapshots' {lay.num_kv_heads} KV heads")
        return chosen, slice(start, stop)

    def _blocks(self, first_block: int, tokens: int) -> slice:
        """The snapshots holding ``tokens`` tokens from block ``first_block``; ValueError outside this hit."""
        blocks = slice(first_block, first_block + -(-tokens // self.block_size))
        if first_block < 0 or tokens <= 0 or len(self.snapshots[blocks]) * self.block_size < tokens:
            raise ValueError(f"{tokens} tokens from block {first_block} are outside this hit of "
                             f"{len(self.snapshots)} blocks")
        return blocks

    # -- handing KV to engines -----------------------------------------------
    def to_dynamic_cache(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, *,
                         model_config: Any = None) -> Any:
        """A transformers ``DynamicCache`` holding the first :attr:`usable_tokens` tokens.

        The cache covers a *strict* prefix of the prompt, as ``generate()`` needs:
        ``model.generate(input_ids, cache=cache)`` computes only the rest, and for a plain
        forward pass feed ``input_ids[:, hit.usable_tokens:]``.

        Args:
            device: where the KV goes (FP8 bytes are moved there, then dequantised there).
            dtype: the model's compute dtype.
            model_config: the model's transformers config (default: the loader's, or the
                one in the model directory the loader was given).

        Raises:
            ValueError: the config's layer count differs from the snapshots'.
            RuntimeError: the hit was released.
        """
        self._check_live()
        t0 = time.perf_counter()
        cfg = model_config if model_config is not None else self._loader.model_config()
        lay = self.layout
        if cfg is not None:
            layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg.get_text_config(), "num_hidden_layers")
            if layers != lay.num_layers:
                raise ValueError(f"the model config has {layers} layers; the snapshots have {lay.num_layers}")
        cache = new_dynamic_cache(cfg)  # transformers is imported only here: serving nodes may lack it
        kv = self.dequantized(dtype, device=device)
        for i in range(lay.num_layers):
            put_layer(cache, i, kv[2 * i][None], kv[2 * i + 1][None])
        self._loader.metrics.observe("to_dynamic_cache", time.perf_counter() - t0)
        return cache

    def dequantized(self, dtype: torch.dtype, *, first_block: int = 0, tokens: int | None = None,
                    device: str | torch.device = "cpu", layers: Sequence[int] | None = None,
                    heads: slice | None = None) -> list[torch.Tensor]:
        """K and V of every layer, ``[K.0, V.0, K.1, ...]``, each ``[kv_heads, tokens, head_dim]`` in ``dtype``.

        They start at block ``first_block`` of the hit and hold ``tokens`` tokens (default: up to
        :attr:`usable_tokens`): what an engine copies into its own cache layout.

        Args:
            layers: only these snapshot layers (distinct), in this order: ``[K.a, V.a, K.b, ...]``
                for ``layers=[a, b]`` (a pipeline stage's layers).
            heads: only these KV heads (a range, step 1): each tensor is then
                ``[heads.stop - heads.start, tokens, head_dim]`` (a tensor-parallel rank's heads).
                The other layers' and heads' stored bytes are not read: on the CPU the native gather
                runs only the selected heads' jobs; elsewhere each part is a view of its heads.

        Raises:
            ValueError: the range is outside the hit, or ``layers``/``heads`` are not the snapshots'.
            RuntimeError: the hit was released.
        """
        self._check_live()
        chosen, share = self._share(layers, heads)
        if tokens is None:
            tokens = self.usable_tokens - first_block * self.block_size
        blocks = self._blocks(first_block, tokens)
        snaps = self.snapshots[blocks]
        g = snaps[0].header.precision.group_tokens
        dq = self._loader.dequantizer
        if torch.device(device).type == "cpu":  # whole payloads at once where the layout allows
            payloads = [s.payload for s in snaps]
            if all(p is not None for p in payloads):
                kv = dq.payload_layers(payloads, tokens, dtype, layers=chosen,  # type: ignore[arg-type]
                                       heads=(share.start, share.stop))
                if kv is not None:
                    return kv
        runs = [self._parts(i, name, blocks, share) for i in chosen for name in ("k", "v")]
        return dq.layers(runs, tokens, dtype, device, g)

    def into_cpu_blocks(self, caches: Sequence[torch.Tensor], layout: "EngineLayout", ids: Sequence[int], *,
                        first_block: int, tokens: int, layers: Sequence[int] | None = None,
                        heads: slice | None = None, skip: int = 0) -> bool:
        """K and V of ``tokens`` tokens from block ``first_block`` dequantised straight into vLLM's CPU cache
        blocks: token ``skip + i`` into engine block ``ids[i // layout.block_size]`` of ``caches`` (one per
        layer of ``layers``, in that order). The bits of :meth:`dequantized` then
        :func:`store.engines.vllm.paging.write_layer`, with no tensor of every layer between (one native
        pass per snapshot). ``False``, nothing written, where it does not apply (another cache layout or
        dtype, no native module, the ``compiled`` mode, layers stored in fp16): the caller does those two steps.

        Raises:
            ValueError: the range is outside the hit, ``layers``/``heads`` are not the snapshots', or the
                tokens from ``skip`` are not ``len(ids)`` whole engine blocks.
            RuntimeError: the hit was released.
        """
        self._check_live()
        if layout.kind != "cpu_vec" or self._loader.dequantizer.mode == "compiled":
            return False
        chosen, share = self._share(layers, heads)
        payloads = [s.payload for s in self.snapshots[self._blocks(first_block, tokens)]]
        if any(p is None or p[1] is not payloads[0][1] for p in payloads):  # type: ignore[index]
            return False
        plan = payload_plan(payloads[0][1])  # type: ignore[index]
        if plan is None:
            return False
        return gather_payloads_vec([p[0] for p in payloads], plan, tokens, caches, ids,  # type: ignore[index]
                                   engine_block=layout.block_size, skip=skip, layers=chosen,
                                   heads=(share.start, share.stop))

    def stored(self, *, first_block: int, blocks: int, device: str | torch.device, layer: int,
               heads: slice | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One layer's K and V of ``blocks`` blocks from ``first_block``, moved to ``device`` as stored (FP8
        bytes, not dequantised): ``[2 (K, V), blocks, kv_heads, block_size, head_dim]`` and the scales
        ``[2, blocks, kv_heads]`` (per group ``[2, blocks, kv_heads, groups]``; ``None`` unquantised), for
        :func:`store.kernels.scatter.dequantise_scatter`.

        ``heads`` as for :meth:`dequantized`. ``None`` where the parts are not uniform (not one shape, dtype
        and kind of scales): :meth:`dequantized` then.

        Raises:
            ValueError: the blocks are outside the hit, or ``layer``/``heads`` are not the snapshots'.
            RuntimeError: the hit was released.
        """
        self._check_live()
        (chosen,), share = self._share([layer], heads)
        span = slice(first_block, first_block + blocks)
        if first_block < 0 or blocks <= 0 or first_block + blocks > len(self.snapshots):
            raise ValueError(f"{blocks} blocks from block {first_block} are outside this hit of "
                             f"{len(self.snapshots)} blocks")
        runs = [self._parts(chosen, name, span, share) for name in ("k", "v")]
        return stage_runs(runs, torch.device(device), self._loader.dequantizer.staging)

    def scatter(self, cache: torch.Tensor, layout: EngineLayout, ids: torch.Tensor, *, first_block: int, blocks: int,
                layer: int, heads: slice | None = None, skip: int = 0) -> bool:
        """One layer's K and V of ``blocks`` blocks from ``first_block`` written into engine blocks ``ids`` of
        ``cache`` (a device's: engine block ``skip + i`` of those tokens into ``ids[i]``), chunk by chunk
        through the device's one reservation (:func:`store.kernels.chunks.scatter_stored`): the bits of
        :meth:`dequantized` then :func:`store.engines.vllm.paging.write_layer`, in bounded device memory.

        ``heads`` as for :meth:`dequantized`. ``False`` (nothing written) where the parts are not uniform
        (not one shape, dtype and kind of scales): :meth:`dequantized` then.

        Raises:
            ValueError: the blocks are outside the hit, or ``layer``/``heads`` are not the snapshots'.
            ConfigError: ``loader.device_scratch_bytes`` cannot hold one block's work.
            RuntimeError: the hit was released.
        """
        self._check_live()
        (chosen,), share = self._share([layer], heads)
        if first_block < 0 or blocks <= 0 or first_block + blocks > len(self.snapshots):
            raise ValueError(f"{blocks} blocks from block {first_block} are outside this hit of "
                             f"{len(self.snapshots)} blocks")
        span = slice(first_block, first_block + blocks)
        runs = [self._parts(chosen, name, span, share) for name in ("k", "v")]
        dq = self._loader.dequantizer
        return scatter_stored(cache, layout, ids, runs, skip=skip, staging=dq.staging,
                              reservation=dq.reservation(cache.device),
                              group_tokens=self.snapshots[first_block].header.precision.group_tokens)

    def copy_into_paged(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], *,
                        partial: bool = False) -> int:
        """Fill vLLM-layout paged caches (per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``).

        Token ``t`` of the prefix goes to engine block ``block_ids[t // engine_block_size]``.
        Writes at most :attr:`usable_tokens` (the engine computes the last prompt token)
        and at most what ``block_ids`` can hold; by default only whole engine blocks (what
        an engine counts as computed), with ``partial=True`` also the tokens of a last,
        partly covered engine block.

        Returns:
            The number of prefix tokens written (the engine's computed-token count).

        Raises:
            ValueError: caches whose layer count, heads, head size or dtype do not fit.
        """
        self._check_live()
        t0 = time.perf_counter()
        lay = self.layout
        ebs = check_paged(kv_caches, lay.num_layers, lay.num_kv_heads, lay.head_dim)
        n = min(self.usable_tokens, len(block_ids) * ebs)
        if not partial:
            n -= n % ebs
        if any(not 0 <= int(b) < kv_caches[0].shape[1] for b in block_ids[: -(-n // ebs) if n else 0]):
            raise ValueError(f"block_ids must index the caches' {kv_caches[0].shape[1]} blocks")
        g = self.snapshots[0].header.precision.group_tokens
        for i in range(lay.num_layers):
            fill_paged(kv_caches[i], 0, self._parts(i, "k"), block_ids, n, g, self._loader.dequantizer)
            fill_paged(kv_caches[i], 1, self._parts(i, "v"), block_ids, n, g, self._loader.dequantizer)
        self._loader.metrics.observe("copy_into_paged", time.perf_counter() - t0)
        return n
