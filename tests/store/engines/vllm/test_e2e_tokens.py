"""Done-when 1, end to end: prefixes stored by ``prefill warm`` load into a real vLLM engine, same tokens.

``prefill warm --model PATH`` (this venv, transformers) stores the prefixes; a vLLM engine
serving the same PATH with ``KvwarmConnector`` (the engine venv) then gets prompts that
begin with them. The greedy tokens must equal those of vLLM without the connector (bf16
storage), or agree on at least 95 % (FP8 storage). The load is proven by kvwarm's own
counters and the request's ``kv_transfer_params``: vLLM's ``num_cached_tokens`` is not
corrected after a failed load, so it alone proves nothing.
"""
from __future__ import annotations

import pytest

from bench.lib.vllm_engine import run_engine
from tests.store.engines.vllm.conftest import SAME, connector
from tests.store.engines.vllm.harness import (
    TENANT,
    agreement,
    count,
    engine_spec,
    entry,
    expected_load,
    outcome,
    prefill_warm,
    reasons,
    request,
    tiny_dir,
    write_config,
)
from tests.store.engines.vllm.prompts import PROMPTS, all_ids, chat_prefix_ids


def stored_tokens(name: str) -> int:
    """Tokens of the prompt's stored prefix in whole kvwarm blocks (256)."""
    n = len(chat_prefix_ids()) if name == "chat" else PROMPTS[name].stored
    return n // 256 * 256


def expected(name: str) -> int:
    return expected_load(stored_tokens(name), len(all_ids()[name]))


def test_a_bf16_store_gives_vllm_the_cold_tokens_and_kvwarm_loaded_the_prefixes(bf16_engine, cold):
    names = [*SAME, "chat"]
    calls = bf16_engine.calls("warm")
    for name, call in zip(names, calls):
        assert call["tokens"] == cold[name], f"{name}: tokens differ from vLLM without the connector"
        assert outcome(call).get("loaded_tokens") == expected(name), (name, outcome(call))
        assert call["num_cached_tokens"] == expected(name), name
    # 512 + 640 (three stored blocks, one prompt token left) + 256 + 0 + 512 (chat-keyed)
    assert [expected(n) for n in names] == [512, 640, 256, 0, 512]
    stats = bf16_engine.stats("warm")
    assert count(stats, "tokens_loaded") == sum(expected(n) for n in names)
    assert count(stats, "hits") == 4 and count(stats, "lookups") == 5
    assert reasons(stats, "misses") == {"short_prompt": 1}
    assert not reasons(stats, "load_failures")


def test_the_connector_keys_a_prompt_as_prefill_warm_model_path_stored_it(bf16_store, bf16_engine):
    """The contract's "keys are equal": same model and tokenizer fingerprints, same chat-template tokens."""
    from store.config import load_config
    from store.identity.fingerprint import identity_from_dir
    from store.identity.keys import block_chain

    cfg = load_config(bf16_store)
    salt = cfg.tenant(TENANT).salt
    written = {p.stem for p in (bf16_store.parent / "store" / "objects" / TENANT).rglob("*.kvw")}
    plain_keys, chat_keys = bf16_engine.step("keys")["keys"]
    ids = all_ids()
    for chat, keys, prompt in ((False, plain_keys, ids["two_blocks"]), (True, chat_keys, ids["chat"])):
        root = identity_from_dir(tiny_dir(), chat=chat).key_root(cfg.kv_cache.precision(), 256, salt)
        prefill_side = [b.key for b in block_chain(root, prompt)]
        assert keys == prefill_side
        assert set(keys[:2]) <= written  # the two stored blocks are the files prefill warm wrote
    assert not set(plain_keys) & set(chat_keys)  # the chat template's hash is in the root


@pytest.fixture(scope="module")
def fp8_engine(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression="fp8")
    names = [n for n in SAME if PROMPTS[n].stored >= 256]
    prefill_warm(cfg, [entry(PROMPTS[n].prefix) for n in names])
    ids = all_ids()
    steps = [{"name": "warm", "requests": [request(ids[n]) for n in names], "together": True}]
    return names, run_engine(engine_spec(steps, extra=connector(cfg, write_back=False)), d / "engine")


def test_an_fp8_store_agrees_on_at_least_95_percent_of_the_tokens(fp8_engine, cold):
    names, run = fp8_engine
    calls = run.calls("warm")
    for name, call in zip(names, calls):
        assert outcome(call).get("loaded_tokens") == expected(name), (name, outcome(call))
    got = [t for c in calls for t in c["tokens"]]
    want = [t for n in names for t in cold[n]]
    assert agreement(got, want) >= 0.95
    stats = run.stats("warm")
    assert count(stats, "tokens_loaded") == sum(expected(n) for n in names)
    assert not reasons(stats, "load_failures")
