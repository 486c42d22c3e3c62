"""Which of the model's layers and KV heads one engine worker holds, and the layouts kvwarm refuses.

vLLM spreads a model over workers two ways. Pipeline parallel (``--pipeline-parallel-size``)
gives each stage a contiguous run of layers, whose caches it registers under their global
names (``model.layers.16.self_attn.attn`` on the second stage of a 32-layer model); tensor
parallel (``--tensor-parallel-size``) gives each rank an equal share of every layer's KV heads.
A snapshot holds every layer and head, so a worker reads the share it holds: snapshot layer
``layers[i]`` into its ``i``-th registered cache, heads :func:`head_range`.

Write-back needs the whole KV of a block in one worker (a snapshot is one file, written
atomically, and visible as soon as it is written), so it is off whenever a worker holds a
share (:func:`write_back_refusal`). What cannot be loaded right is refused at start-up,
naming the model and the setting (:func:`check_model`, :func:`order_layers`).

Pure functions over names and numbers: the connector reads them off vLLM's objects.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from store.engines.vllm.settings import ConnectorConfigError

#: speculative methods (``--speculative-config {"method": ...}``) whose draft keeps no KV cache
NO_DRAFT_KV = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")


def check_model(model: str, *, mla: bool, groups: int, group_kinds: Sequence[str] = (),
                window: int | None = None, speculative: str | None = None, draft_kv: bool = False,
                kv_heads: int = 1, tp_size: int = 1) -> None:
    """Refuse what kvwarm cannot fill right, whatever the parallel layout.

    Args:
        model: the served model (named in the messages).
        mla: the model's attention is multi-head latent attention (vLLM's ``MLAAttentionSpec``).
        groups: vLLM's KV cache groups; ``group_kinds`` their spec class names.
        window: the sliding window (or local-attention chunk) of layers in the one group, or ``None``:
            vLLM puts sliding-window layers in the full-attention group when its hybrid KV cache
            manager is off, as it is for every connector that does not declare support for it.
        speculative: the ``--speculative-config`` method, or ``None``.
        draft_kv: that method's draft model keeps KV caches of its own (vLLM's ``uses_draft_kv_cache``).
        kv_heads, tp_size: the model's KV heads and ``--tensor-parallel-size``.

    Raises:
        ConnectorConfigError: naming the model and the setting.
    """
    if mla:
        raise ConnectorConfigError(
            f"kvwarm connector: {model} uses multi-head latent attention (MLA): vLLM caches one latent vector "
            "per token and layer, not per-head K and V, and kvwarm's snapshots hold per-head K and V; serve this "
            "model without kv_connector KvwarmConnector in --kv-transfer-config")
    if groups != 1:
        kinds = f" ({', '.join(group_kinds)})" if group_kinds else ""
        raise ConnectorConfigError(
            f"kvwarm connector: {model} has {groups} KV cache groups{kinds}, a hybrid model (sliding-window, "
            "Mamba or other layers with a cache of their own); kvwarm fills models whose attention layers share "
            "one group; serve this model without kv_connector KvwarmConnector in --kv-transfer-config")
    if window is not None:
        raise ConnectorConfigError(
            f"kvwarm connector: {model} has sliding-window (or chunked local) attention layers, window {window}: "
            "kvwarm's prefill computes snapshots with transformers, whose cache keeps only the last window of "
            "such a layer's KV, so no snapshot holds their KV for a whole prefix; serve this model without "
            "kv_connector KvwarmConnector in --kv-transfer-config")
    if tp_size > kv_heads:
        raise ConnectorConfigError(
            f"kvwarm connector: {model} has {kv_heads} KV heads, fewer than --tensor-parallel-size {tp_size}: vLLM "
            "then replicates heads across ranks, which kvwarm does not fill; use a tensor-parallel size of at most "
            f"{kv_heads}")
    if speculative is not None and draft_kv:
        raise ConnectorConfigError(
            f"kvwarm connector: {model} is served with speculative decoding whose draft keeps its own KV cache "
            f"(--speculative-config method {speculative!r}); the draft's attention layers register caches beside "
            "the target's, and kvwarm's snapshots hold the target model's layers only (a load would leave the "
            f"draft's KV of the loaded tokens unwritten); drop --speculative-config or use a method without draft "
            f"KV ({', '.join(NO_DRAFT_KV)})")


def order_layers(indices: Mapping[str, int], *, model: str, total_layers: int, stage: tuple[int, int],
                 group_layers: Sequence[str]) -> tuple[list[str], list[int]]:
    """The registered caches in layer order, and each one's global layer index (what it loads).

    Args:
        indices: registered layer name -> its global layer index (vLLM's ``extract_layer_index``).
        model: the served model (named in the messages).
        total_layers: the model's layers (what a snapshot holds).
        stage: ``[start, stop)``, the layers this worker's pipeline stage holds (all of them without
            pipeline parallel).
        group_layers: the layer names of vLLM's KV cache group (``kv_cache_groups[0].layer_names``).

    Raises:
        ConnectorConfigError: a cache the group does not list (or a listed one not registered), two
            caches of one layer, or a layer outside the stage or the model: another model's layers (a
            draft model, ``--speculative-config``) or a pipeline split kvwarm cannot follow.
    """
    registered, listed = set(indices), set(group_layers)
    if registered != listed:
        raise ConnectorConfigError(
            f"kvwarm connector: the KV caches vLLM registered for {model} are not the layers of its KV cache "
            f"group: registered only {sorted(registered - listed)}, in the group only {sorted(listed - registered)}; "
            "kvwarm fills models whose attention layers share one group (no --speculative-config draft, no "
            "cross-attention)")
    names = sorted(indices, key=lambda n: (indices[n], n))
    seen: dict[int, str] = {}
    start, stop = stage
    for name in names:
        i = indices[name]
        if i in seen:
            raise ConnectorConfigError(
                f"kvwarm connector: the KV caches {seen[i]!r} and {name!r} of {model} are both layer {i}: a draft "
                "model's layers (--speculative-config) or cross-attention; kvwarm's snapshots hold one cache per "
                "layer of the target model")
        seen[i] = name
        if not 0 <= i < total_layers:
            raise ConnectorConfigError(
                f"kvwarm connector: the KV cache {name!r} is layer {i}, but {model} has {total_layers} layers: a "
                "draft model's layers (EAGLE numbers them after the target's; --speculative-config) are not in "
                "kvwarm's snapshots; drop --speculative-config")
        if not start <= i < stop:
            raise ConnectorConfigError(
                f"kvwarm connector: the KV cache {name!r} is layer {i}, outside this pipeline stage's layers "
                f"{start}-{stop - 1} of {model} (--pipeline-parallel-size, VLLM_PP_LAYER_PARTITION)")
    return names, [indices[n] for n in names]


def head_range(tp_rank: int, local_heads: int) -> slice:
    """The KV heads tensor-parallel rank ``tp_rank`` holds, ``local_heads`` of them (vLLM's even split)."""
    return slice(tp_rank * local_heads, (tp_rank + 1) * local_heads)


def write_back_refusal(tp_size: int, pp_size: int) -> str | None:
    """Why this layout cannot write back (no worker holds a whole snapshot), or ``None`` when it can."""
    if pp_size > 1:
        return (f"with --pipeline-parallel-size {pp_size} each stage holds only its own layers, and a snapshot "
                "holds every layer (one file, visible once written); loads are unaffected")
    if tp_size > 1:
        return (f"with --tensor-parallel-size {tp_size} no worker holds every KV head; loads are unaffected")
    return None
