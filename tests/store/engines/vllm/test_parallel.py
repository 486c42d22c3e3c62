"""Parallel layouts, without vLLM: the registered caches in global layer order, each rank's heads, and what
is refused at start-up (every message names the model and the setting to change)."""
from __future__ import annotations

import pytest

from store.engines.vllm.parallel import check_model, head_range, order_layers, write_back_refusal
from store.engines.vllm.settings import ConnectorConfigError

MODEL = "/models/llama-32l"


def names(*layers: int, prefix: str = "model.layers") -> dict[str, int]:
    return {f"{prefix}.{i}.self_attn.attn": i for i in layers}


def test_a_second_stage_holds_its_global_layers_in_order():
    got = names(17, 16, 31, *range(18, 31))  # vLLM's dict order is not the layer order
    order, layers = order_layers(got, model=MODEL, total_layers=32, stage=(16, 32), group_layers=list(got))
    assert layers == list(range(16, 32))
    assert order[0] == "model.layers.16.self_attn.attn" and order[-1] == "model.layers.31.self_attn.attn"


def test_caches_the_kv_cache_group_does_not_list_are_refused():
    got = names(0, 1)
    with pytest.raises(ConnectorConfigError, match=r"registered only \['model.layers.1.self_attn.attn'\]"):
        order_layers(got, model=MODEL, total_layers=2, stage=(0, 2), group_layers=["model.layers.0.self_attn.attn"])
    with pytest.raises(ConnectorConfigError, match=r"in the group only \['x'\]"):
        order_layers(got, model=MODEL, total_layers=2, stage=(0, 2), group_layers=[*got, "x"])


def test_a_draft_models_layers_are_refused_naming_the_setting():
    # vLLM's draft_model method builds the draft under the prefix "draft_model": its layer 0 beside the target's
    target, draft = names(0, 1), names(0, 1, prefix="draft_model.model.layers")
    both = {**target, **draft}
    with pytest.raises(ConnectorConfigError, match=r"both layer 0.*--speculative-config") as e:
        order_layers(both, model=MODEL, total_layers=2, stage=(0, 2), group_layers=list(both))
    assert "draft_model.model.layers.0.self_attn.attn" in str(e.value) and MODEL in str(e.value)
    # EAGLE numbers its layers after the target's (model.layers.2 of a 2-layer target), in the same group
    eagle = names(0, 1, 2)
    with pytest.raises(ConnectorConfigError, match=r"'model.layers.2.self_attn.attn' is layer 2, but "
                                                   r"/models/llama-32l has 2 layers.*--speculative-config"):
        order_layers(eagle, model=MODEL, total_layers=2, stage=(0, 2), group_layers=list(eagle))


def test_a_layer_outside_the_stage_is_refused_naming_the_pipeline_setting():
    got = names(14, 15, 16)
    with pytest.raises(ConnectorConfigError, match=r"outside this pipeline stage's layers 16-31.*"
                                                   r"--pipeline-parallel-size"):
        order_layers(got, model=MODEL, total_layers=32, stage=(16, 32), group_layers=list(got))


def test_each_tensor_parallel_rank_holds_its_run_of_heads():
    assert [head_range(r, 2) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]


@pytest.mark.parametrize("facts, match", [
    (dict(mla=True, groups=1), r"multi-head latent attention.*--kv-transfer-config"),
    (dict(mla=False, groups=2, group_kinds=["FullAttentionSpec", "SlidingWindowSpec"]),
     r"2 KV cache groups \(FullAttentionSpec, SlidingWindowSpec\).*--kv-transfer-config"),
    (dict(mla=False, groups=1, window=4096), r"sliding-window .* window 4096.*--kv-transfer-config"),
    (dict(mla=False, groups=1, speculative="eagle3", draft_kv=True), r"method 'eagle3'.*--speculative-config"),
    (dict(mla=False, groups=1, kv_heads=8, tp_size=16), r"8 KV heads, fewer than --tensor-parallel-size 16"),
])
def test_what_cannot_be_filled_right_is_refused_naming_the_model_and_the_setting(facts, match):
    with pytest.raises(ConnectorConfigError, match=match) as e:
        check_model(MODEL, **facts)
    assert MODEL in str(e.value)


def test_what_can_be_filled_passes():
    check_model(MODEL, mla=False, groups=1)
    check_model(MODEL, mla=False, groups=1, speculative="ngram", draft_kv=False, kv_heads=8, tp_size=8)


def test_write_back_is_off_where_no_worker_holds_a_whole_snapshot():
    assert write_back_refusal(1, 1) is None
    assert "--pipeline-parallel-size 2" in write_back_refusal(1, 2)
    assert "--pipeline-parallel-size 2" in write_back_refusal(4, 2)
    assert "--tensor-parallel-size 4" in write_back_refusal(4, 1)
